"""The compiled skinny GEMM against fp64 truth on awkward shapes, both weight dtypes, every ISA
this CPU has (AVX-512 machines test the AVX2 path too)."""

import pytest
import torch

from tests.kernels.conftest import assert_close_to_truth, extension

# N, K: not multiples of 16 or 32, smaller than one vector, and one K tile plus a ragged rest.
SHAPES = [(1, 1), (5, 7), (37, 100), (64, 64), (33, 1000), (3, 2049), (130, 33)]
DTYPES = [torch.float32, torch.bfloat16]


def isas():
    return extension().isas()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_against_truth_every_isa_and_row_count(n, k, dtype):
    ext = extension()
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g)
    for isa in isas():
        for m in range(1, 18):  # one pass of 16 rows, and a second of 1
            x = torch.randn(m, k, generator=g)
            assert_close_to_truth(ext.linear(x, w, b if m % 2 else None, isa), x, w, b if m % 2 else None)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_non_contiguous_x(dtype):
    ext = extension()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(45, 70, generator=g).to(dtype)
    for isa in isas():
        x = torch.randn(6, 140, generator=g)[:, ::2]  # strided columns
        assert not x.is_contiguous()
        assert_close_to_truth(ext.linear(x, w, None, isa), x, w, None)
        xt = torch.randn(70, 3, generator=g).T  # transposed
        assert_close_to_truth(ext.linear(xt, w, None, isa), xt, w, None)


def test_many_rows_and_large_values():
    """More rows than one pass (40 = 16 + 16 + 8) and values far from 1: the scale is relative."""
    ext = extension()
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(19, 301, generator=g) * 1e3).bfloat16()
    x = torch.randn(40, 301, generator=g) * 1e-3
    for isa in isas():
        assert_close_to_truth(ext.linear(x, w, None, isa), x, w, None)


def test_empty_inputs():
    ext = extension()
    for isa in isas():
        assert ext.linear(torch.randn(0, 8), torch.randn(5, 8), None, isa).shape == (0, 5)
        y = ext.linear(torch.randn(3, 0), torch.randn(4, 0), torch.arange(4.0), isa)  # K = 0: just the bias
        assert torch.equal(y, torch.arange(4.0).expand(3, 4))


def test_bad_arguments_are_refused():
    ext = extension()
    with pytest.raises(RuntimeError, match="x must be float32"):
        ext.linear(torch.randn(2, 8).double(), torch.randn(3, 8), None)
    with pytest.raises(RuntimeError, match="columns"):
        ext.linear(torch.randn(2, 8), torch.randn(3, 9), None)
    with pytest.raises(RuntimeError, match="not available"):
        ext.linear(torch.randn(2, 8), torch.randn(3, 8), None, "sve")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_tail_reads_nothing_past_k(dtype):
    """The last K step of a row must not use what lies after it in memory: here the next row's
    start, and after the last row, infinities (0 * inf would poison the sum)."""
    ext = extension()
    g = torch.Generator().manual_seed(3)
    n, k = 37, 45  # 32 rows for AMX, 5 for AVX-512
    storage = torch.full((n * k + 64,), float("inf")).to(dtype)
    storage[: n * k] = torch.randn(n * k, generator=g).to(dtype)
    w = storage[: n * k].view(n, k)
    x = torch.randn(3, k, generator=g)
    for isa in isas():
        assert_close_to_truth(ext.linear(x, w, None, isa), x, w, None)


@pytest.mark.parametrize("n,k", [(32, 32), (64, 100), (96, 1024)])
def test_x_keeps_all_24_bits(n, k):
    """Positive terms (no cancellation) and x with full fp32 mantissas: any path that rounds x,
    or splits it into too few bf16 parts (AMX), is off by far more than fp32 rounding."""
    ext = extension()
    g = torch.Generator().manual_seed(4)
    x = 1 + torch.rand(16, k, generator=g)
    w = torch.rand(n, k, generator=g).bfloat16()
    for isa in isas():
        for m in (1, 5, 16):
            assert_close_to_truth(ext.linear(x[:m], w, None, isa), x[:m], w, None)


# The register tile each ISA runs for few (1-2), 5-8 and the other row counts of x (gemv_avx2.cpp /
# gemv_avx512.cpp), by weight dtype.
TILES = {"avx2": {"fp32": ("4x2", "3x4", "3x4"), "bf16": ("4x2", "4x2", "4x2")},
         "avx512": {"fp32": ("4x4", "3x8", "4x4"), "bf16": ("4x4", "4x4", "4x4")}}


def row_class(m, narrow):
    return 0 if m <= 2 or narrow else 1 if 5 <= m <= 8 else 2


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k", [(37, 1000), (130, 33), (1031, 2049)])
def test_each_register_tile_runs_and_is_exact(n, k, dtype):
    """Each row range's own tile computes the call (`last_tile` says which), against the truth:
    blocks of 3 or 4 W rows with a short last one, passes of 4 or 8 x rows with a short last one, K
    tiles with a ragged rest, both threads. narrow=True sends every row count through the few-rows tile."""
    ext = extension()
    name = "fp32" if dtype == torch.float32 else "bf16"
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g)
    for isa in [i for i in isas() if i in TILES]:
        for m in range(1, 18):
            x = torch.randn(m, k, generator=g)
            for narrow in (False, True):
                y = ext.linear(x, w, b, isa, narrow)
                assert ext.last_tile() == TILES[isa][name][row_class(m, narrow)], (isa, m, narrow)
                assert_close_to_truth(y, x, w, b)


@pytest.mark.parametrize("n,k", [(1321, 64), (37, 1000), (130, 33)])
def test_a_row_gets_the_same_bits_whatever_rows_run_beside_it(n, k):
    """fp32 weights on every ISA (AMX serves only bf16 and int8): row i of a call over m rows is the call
    over row i alone, bit for bit. The compiled MTP head relies on it (it runs only the last row past its
    attention, csrc/decode_block.cpp)."""
    ext = extension()
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    for isa in isas():
        for m in range(2, 18):
            x = torch.randn(m, k, generator=g)
            y = ext.linear(x, w, None, isa)
            for i in (0, m // 2, m - 1):
                assert torch.equal(y[i : i + 1], ext.linear(x[i : i + 1].clone(), w, None, isa)), (isa, m, i)


# AMX: one pass over the weights for up to 32 rows of x (two x blocks of 16), chunks of 32 beyond.
AMX_SHAPES = [(32, 32), (37, 100), (96, 1000), (64, 160), (33, 2049)]


@pytest.mark.parametrize("n,k", AMX_SHAPES)
def test_amx_up_to_32_rows_in_one_pass(n, k):
    """17..32 rows (the second x block ragged or whole), and 33..70 (a second chunk that re-reads each
    W block): exact against the truth, and `last_amx_passes` says how many chunks ran: 1 up to 32 rows."""
    ext = extension()
    if "amx" not in ext.isas():
        pytest.skip("this CPU has no AMX")
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g)
    for m in [3, 16, 17, 18, 24, 31, 32, 33, 40, 48, 63, 64, 70]:
        x = torch.randn(m, k, generator=g)
        bias = b if m % 2 else None
        assert_close_to_truth(ext.linear(x, w, bias, "amx"), x, w, bias)
        assert ext.last_amx_passes() == -(-m // 32), m
    x = 1 + torch.rand(32, k, generator=g)  # full 24-bit mantissas, no cancellation: all 3 parts count
    wp = torch.rand(n, k, generator=g).bfloat16()
    assert_close_to_truth(ext.linear(x, wp, None, "amx"), x, wp, None)


def test_amx_32_rows_through_dispatch_is_one_call():
    """kernels.linear sends 32 (and 64) rows with bf16 weights to the extension in one call, which
    runs one AMX pass for 32 rows: the weights stream from memory once."""
    ext = extension()
    if "amx" not in ext.isas():
        pytest.skip("this CPU has no AMX")
    from kvstate import kernels

    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 1024, generator=g).bfloat16()
    for m, passes in [(32, 1), (64, 2)]:
        x = torch.randn(m, 1024, generator=g)
        with kernels.backend("amx"):
            y = kernels.linear(x, w)
        assert ext.last_amx_passes() == passes
        assert_close_to_truth(y, x, w, None)


@pytest.mark.parametrize("m0,m1", [(16, 8), (16, 0), (3, 0), (9, 0), (16, 16)])
def test_amx_tile_configuration_is_what_it_asks_for(m0, m1):
    """The configuration the AMX path loads, read back from the CPU: A tiles 2, 3 of 16 x 64 bytes, C
    0, 1 and B 4 of m0 columns, the rest of m1 (or of m0 when m1 is 0, tile 7 unused). With GCC 12's
    _tile_loadconfig (declared to read 8 of its 64 bytes) the rows and widths could be dropped as dead
    stores: every tile came back unconfigured, and the tile instructions after it raised SIGILL."""
    ext = extension()
    if "amx" not in ext.isas():
        pytest.skip("this CPU has no usable AMX")
    got = ext.amx_configured_tiles(m0, m1)
    rows, widths = got[:8], got[8:]
    second = m1 if m1 else m0
    assert rows == [16] * 7 + [16 if m1 else 0]
    assert widths == [4 * m0, 4 * m0, 64, 64, 4 * m0, 4 * second, 4 * second, 4 * m1]
