"""The AVX512_BF16 path of bf16 weights (vdpbf16ps, kernels.activation): x rounded to bf16 against
fp64 truth of the rounded x, x split in three bf16 parts against exact truth, on awkward shapes.
Skips where the CPU has no AVX512_BF16 (AVX2-only machines, older AVX-512 ones)."""

import pytest
import torch

from kvstate.errors import KvstateError
from kvstate.kernels import activation
from tests.kernels.conftest import assert_close_to_truth, extension

# N, K: below one 32-element step, ragged tails, one step exactly, several blocks of 3 and 4 W rows.
SHAPES = [(1, 1), (5, 7), (37, 100), (13, 32), (33, 1000), (3, 2049), (130, 33)]
ROWS = list(range(1, 18)) + [40, 64]  # every tile width, passes of 8 and their ragged last pass
GEMM_ROWS = 64  # gemv.h kGemmRows: from here on the bf16 mode runs the GEMM


@pytest.fixture
def ext():
    module = extension()
    if not module.has_avx512_bf16():
        pytest.skip("this CPU has no AVX512_BF16")
    yield module
    module.set_activation_parts(0)


def _linear(ext, x, w, b, parts, isa="auto"):
    ext.set_activation_parts(parts)
    try:
        return ext.linear(x, w, b, isa)
    finally:
        ext.set_activation_parts(0)


@pytest.mark.parametrize("n,k", SHAPES)
def test_bf16_activations_are_the_rounded_x_exactly_summed(ext, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g)
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        bias = b if m % 2 else None
        y = _linear(ext, x, w, bias, 1)
        assert ext.last_tile().startswith("bf16dp" if m < GEMM_ROWS else "bf16 gemm")
        # x rounded to bf16 (nearest even, as torch does), then an fp32 sum: within fp32's error of
        # the fp64 product of the rounded x
        assert_close_to_truth(y, x.bfloat16().float(), w, bias)


@pytest.mark.parametrize("n,k", SHAPES)
def test_three_parts_are_exact_math(ext, n, k):
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    for m in ROWS:
        x = torch.randn(m, k, generator=g) * 3.7
        assert_close_to_truth(_linear(ext, x, w, None, 3), x, w, None)


def test_rounding_is_real_and_bounded(ext):
    """The bf16 mode is not exact (the test above could not tell x from its rounding otherwise), and
    its error stays within bf16's half ulp (2^-9) of sum |w x|."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 512, generator=g).bfloat16()
    x = torch.randn(4, 512, generator=g)
    y = _linear(ext, x, w, None, 1)
    with pytest.raises(AssertionError):
        assert_close_to_truth(y, x, w, None)
    assert_close_to_truth(y, x, w, None, rel=2.0**-9 + 1e-6)


def test_other_weights_and_paths_keep_fp32_math(ext):
    """fp32 and int8 weights, the AVX2 path and `narrow` ignore the setting: bit-equal to it off."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 70, generator=g)
    wf = torch.randn(9, 70, generator=g)
    wb = wf.bfloat16()
    q = torch.randint(-127, 128, (9, 70), generator=g, dtype=torch.int8)
    s = torch.rand(9, generator=g)
    assert torch.equal(_linear(ext, x, wf, None, 1), ext.linear(x, wf, None))
    ext.set_activation_parts(1)
    try:
        on = [ext.linear(x, q, None, scale=s), ext.linear(x, wb, None, "avx2"), ext.linear(x, wb, None, narrow=True)]
    finally:
        ext.set_activation_parts(0)
    off = [ext.linear(x, q, None, scale=s), ext.linear(x, wb, None, "avx2"), ext.linear(x, wb, None, narrow=True)]
    assert all(torch.equal(a, b) for a, b in zip(on, off))


def test_the_python_setting_reaches_the_kernel(ext):
    before = dict(ext.paths_run())
    activation.set_activation_dtype("bf16")
    try:
        assert activation.activation_dtype() == "bf16"
        from kvstate.kernels import linear

        x, w = torch.randn(2, 40), torch.randn(8, 40).bfloat16()
        y = linear(x, w)
    finally:
        activation.set_activation_dtype("fp32")
    assert activation.activation_dtype() == "fp32"
    assert dict(ext.paths_run())["linear avx512_bf16"] == before.get("linear avx512_bf16", 0) + 1
    assert_close_to_truth(y, x.bfloat16().float(), w, None)


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(KvstateError, match="expected one of fp32, bf16, bf16x3"):
        activation.set_activation_dtype("fp16")


# M, N, K of the GEMM: one row, ragged 6-row tiles, 64-column panels with a ragged last one, K below
# one step, ragged, and over several 256-k panels.
GEMM_SHAPES = [(1, 64, 32), (16, 64, 32), (17, 5, 7), (23, 130, 100), (40, 64, 513), (61, 200, 1000),
               (100, 3, 2049), (33, 129, 256), (6, 1, 1)]


@pytest.fixture
def gemm_from(ext):
    """set_bf16_gemm_rows: the row count from which the bf16 mode runs the GEMM; put back after."""
    default = ext.set_bf16_gemm_rows(GEMM_ROWS)
    yield ext.set_bf16_gemm_rows
    ext.set_bf16_gemm_rows(default)


@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
def test_gemm_is_the_rounded_x_exactly_summed(ext, gemm_from, m, n, k):
    """The GEMM (forced from 1 row on): x rounded to bf16, fp32 sums and output."""
    gemm_from(1)
    g = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    for bias in (b, None):
        y = _linear(ext, x, w, bias, 1)
        assert ext.last_tile() == "bf16 gemm 6x64"
        assert_close_to_truth(y, x.bfloat16().float(), w, bias)


def test_gemm_and_skinny_kernel_agree_past_the_threshold(ext, gemm_from):
    """The same 100 rows through the GEMM (the default from 64 rows) and the skinny kernel (the
    threshold moved past them): both within fp32 rounding of the rounded x's exact sum."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(70, 600, generator=g).bfloat16()
    x = torch.randn(100, 600, generator=g)
    gemm = _linear(ext, x, w, None, 1)
    assert ext.last_tile() == "bf16 gemm 6x64"
    gemm_from(101)
    skinny = _linear(ext, x, w, None, 1)
    assert ext.last_tile().startswith("bf16dp")
    for y in (gemm, skinny):
        assert_close_to_truth(y, x.bfloat16().float(), w, None)


def test_gemm_threads_split_the_panels(ext, gemm_from):
    """Each thread's panels start on a 64-column boundary: one thread and two give the same bits."""
    gemm_from(1)
    g = torch.Generator().manual_seed(9)
    w = torch.randn(300, 96, generator=g).bfloat16()
    x = torch.randn(30, 96, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _linear(ext, x, w, None, 1)
        torch.set_num_threads(2)
        two = _linear(ext, x, w, None, 1)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_bf16_prefill_rows_run_the_gemm(ext):
    """Past the skinny kernel's rows `linear` keeps the extension in bf16 mode: x rounded to bf16, the
    output fp32 (within fp32 rounding of the rounded x's exact sum), and not the exact result itself."""
    from kvstate.kernels import MAX_ROWS_BF16, linear

    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 300, generator=g).bfloat16()
    x, b = torch.randn(MAX_ROWS_BF16 + 36, 300, generator=g), torch.randn(48, generator=g)
    activation.set_activation_dtype("bf16")
    try:
        before = dict(ext.paths_run()).get("linear avx512_bf16", 0)
        y = linear(x, w, b)
        assert dict(ext.paths_run())["linear avx512_bf16"] == before + 1
    finally:
        activation.set_activation_dtype("fp32")
    with pytest.raises(AssertionError):
        assert_close_to_truth(y, x, w, b)
    assert_close_to_truth(y, x.bfloat16().float(), w, b)
    assert_close_to_truth(linear(x, w, b), x, w, b)  # off again: exact


def test_bf16_prefill_rows_on_amx_keep_torch_gemm(ext, monkeypatch):
    """Where the kernels' automatic ISA is AMX the prefill rows keep torch's bf16 GEMM (the dispatch
    of those machines is unchanged): x and the output rounded to bf16."""
    from kvstate.kernels import MAX_ROWS_BF16, linear

    g = torch.Generator().manual_seed(6)
    w = torch.randn(48, 300, generator=g).bfloat16()
    x = torch.randn(MAX_ROWS_BF16 + 36, 300, generator=g)
    activation.set_activation_dtype("bf16")
    monkeypatch.setattr(activation, "own_gemm", False)
    try:
        y = linear(x, w)
    finally:
        activation.set_activation_dtype("fp32")
    assert torch.equal(y, torch.nn.functional.linear(x.bfloat16(), w).float())


def test_exact_mode_prefill_rows_run_the_gemm_in_three_parts(ext):
    """fp32 math (the default) from 64 rows on: the GEMM with x split in three bf16 parts, within fp32
    rounding of the exact sum (not torch's fp32 GEMM on upcast weights)."""
    from kvstate.kernels import linear

    g = torch.Generator().manual_seed(12)
    w = torch.randn(130, 700, generator=g).bfloat16()
    x, b = torch.randn(GEMM_ROWS + 7, 700, generator=g) * 3.1, torch.randn(130, generator=g)
    assert activation.activation_dtype() == "fp32"
    y = linear(x, w, b)
    assert ext.last_tile() == "bf16 gemm 6x64"
    assert_close_to_truth(y, x, w, b)
    assert_close_to_truth(ext.linear(x, w, b), x, w, b)
