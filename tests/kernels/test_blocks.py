"""GGML quantized blocks (`kernels.ggml_blocks`, `ggml_quantize`, `blocks`) against code we did not write:
our torch dequantizer equals `gguf.quants.dequantize` bit for bit on random blocks (K-quants: random
bytes with finite fp16 scales, since their meaning is the dequantizer's); Q8_0 and Q4_0 quantize to
`gguf.quants.quantize`'s bytes, Q4_K to ggml's `quantize_row_q4_K_ref` (through ctypes, where a
llama.cpp build is at hand); a Linear holding blocks multiplies by exactly the dequantized weights,
through the compiled kernel (each ISA the CPU has) and the torch path."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvstate.bench.quant_q8 import random_blocks
from kvstate.kernels import Linear
from kvstate.kernels.blocks import MAX_ROWS, SUPPORTED, block_linear, set_block_weight
from kvstate.kernels.ggml_blocks import TYPES, dequantize, row_bytes
from kvstate.kernels.ggml_quantize import QUANTIZABLE, quantize
from tests.kernels.conftest import assert_close_to_truth, extension

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

GGML_BASE = Path(os.environ.get("KVSTATE_GGML_BASE", "/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/"
                                                      "build/bin/libggml-base.so"))


def _gguf_type(qtype: str):
    return getattr(gguf.GGMLQuantizationType, qtype)


def test_supported_is_what_we_dequantize():
    assert SUPPORTED == {"Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
    for name, t in TYPES.items():  # block sizes and type numbers as gguf has them
        assert gguf.GGML_QUANT_SIZES[_gguf_type(name)] == (t.block, t.nbytes)
        assert int(_gguf_type(name)) == t.type_id


@pytest.mark.parametrize("qtype", sorted(TYPES))
@pytest.mark.parametrize("rows,blocks", [(1, 1), (5, 3), (33, 2)])
def test_dequantize_equals_gguf_bit_for_bit(qtype, rows, blocks):
    raw = random_blocks(qtype, rows, blocks, seed=rows * 7 + blocks)
    ref = quants.dequantize(raw, _gguf_type(qtype))
    ours = dequantize(torch.from_numpy(raw), qtype)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert np.array_equal(ours.numpy(), ref)


def _awkward_weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]  # rows of very different size
    w[0] = 0  # an all-zero row
    w[1, : k // 2] = 1.5  # constant blocks
    w[2] = w[2].abs()  # all positive (Q4_K's min clamps to 0)
    w[3, 5] = 80.0  # one outlier
    w[4, ::2] = -w[4, ::2].abs()
    return w


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantize_equals_gguf_bytes(qtype):
    w = _awkward_weights(40, 512, seed=1)
    assert np.array_equal(quantize(w, qtype, rows_per_chunk=16).numpy(), quants.quantize(w.numpy(), _gguf_type(qtype)))


def test_quantize_q4_k_equals_ggml_reference():
    if not GGML_BASE.is_file():
        pytest.skip(f"no llama.cpp build at {GGML_BASE} (set KVSTATE_GGML_BASE)")
    lib = ctypes.CDLL(str(GGML_BASE))
    w = _awkward_weights(24, 768, seed=2)
    x = np.ascontiguousarray(w.numpy())
    ref = np.zeros((24, row_bytes("Q4_K", 768)), np.uint8)
    for r in range(24):
        lib.quantize_row_q4_K_ref(x[r].ctypes.data_as(ctypes.c_void_p), ref[r].ctypes.data_as(ctypes.c_void_p),
                                  ctypes.c_int64(768))
    assert np.array_equal(quantize(w, "Q4_K", rows_per_chunk=10).numpy(), ref)


@pytest.mark.parametrize("qtype", sorted(QUANTIZABLE))
def test_quantized_weights_are_close(qtype):
    """A sanity bound, independent of the reference: 8 bits within half a step, 4 bits within ~1/8 of the range."""
    w = torch.randn(16, 512, generator=torch.Generator().manual_seed(3))
    err = (dequantize(quantize(w, qtype), qtype) - w).abs().max() / w.abs().max()
    assert err < (0.01 if qtype == "Q8_0" else 0.15), err


def _block_linear(qtype: str, n: int, k: int, bias: bool, seed: int) -> tuple[Linear, torch.Tensor]:
    m = Linear(k, n, bias=bias)
    raw = torch.from_numpy(random_blocks(qtype, n, k // TYPES[qtype].block, seed))
    set_block_weight(m, raw, qtype)
    return m, dequantize(raw, qtype)


@pytest.mark.parametrize("qtype", sorted(TYPES))
@pytest.mark.parametrize("n,k,rows", [(1, 256, 1), (37, 512, 3), (300, 768, 17)])
def test_linear_multiplies_by_the_dequantized_weights(qtype, n, k, rows):
    m, w = _block_linear(qtype, n, k, bias=rows % 2 == 1, seed=n + k)
    x = torch.randn(2, rows, k, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        y = m(x)
        ref = F.linear(x.double(), w.double(), None if m.bias is None else m.bias.double())
    assert y.shape == (2, rows, n) and y.dtype == torch.float32
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_state_dict_repr_and_reload():
    m, w = _block_linear("Q4_K", 8, 512, bias=True, seed=4)
    sd = m.state_dict()
    assert sd["weight"].dtype == torch.uint8 and tuple(sd["weight"].shape) == (8, 2 * 144)
    assert int(sd["weight_type"]) == 12  # GGML_TYPE_Q4_K
    assert "weight_dtype=Q4_K" in repr(m)
    twin = Linear(512, 8)
    set_block_weight(twin, torch.zeros(8, 288, dtype=torch.uint8), "Q4_K")
    twin.load_state_dict(sd)
    x = torch.randn(3, 512)
    with torch.no_grad():
        assert torch.equal(twin(x), m(x))
    assert torch.equal(block_linear(x, sd["weight"], sd["bias"], "Q4_K"), m(x).detach())


def test_set_block_weight_refuses_what_does_not_fit():
    m = Linear(512, 8)
    with pytest.raises(ValueError, match="Q2_K blocks are not supported"):
        set_block_weight(m, torch.zeros(8, 168, dtype=torch.uint8), "Q2_K")
    with pytest.raises(ValueError, match=r"expected uint8 \[8, 288\], got uint8 \[8, 287\]"):
        set_block_weight(m, torch.zeros(8, 287, dtype=torch.uint8), "Q4_K")
    with pytest.raises(ValueError, match="got int8"):
        set_block_weight(m, torch.zeros(8, 288, dtype=torch.int8), "Q4_K")
    with pytest.raises(ValueError, match="multiple of 256 weights; this Linear's rows have 100"):
        set_block_weight(Linear(100, 8), torch.zeros(8, 144, dtype=torch.uint8), "Q4_K")
    assert m.weight.dtype == torch.float32  # untouched by the refusals


@pytest.mark.parametrize("qtype", sorted(TYPES))
@pytest.mark.parametrize("n,k", [(1, 256), (37, 512), (130, 1280)])
def test_compiled_kernel_against_gguf_dequantize_on_each_isa(qtype, n, k):
    """Every ISA this CPU has, 1 to 17 rows (the single pass of up to 4 rows and the buffered row
    beyond), with and without bias, against float64 sums over `gguf.quants.dequantize`'s weights
    (elementwise, within 1e-6 of the sum of |terms|: random K-quant blocks cancel heavily)."""
    ext = extension()
    t = TYPES[qtype]
    raw = random_blocks(qtype, n, k // t.block, seed=n * k)
    w = torch.from_numpy(quants.dequantize(raw, _gguf_type(qtype))).double()
    g = torch.Generator().manual_seed(n)
    b = torch.randn(n, generator=g)
    for isa in [i for i in ext.isas() if i != "amx"]:
        for m in (1, 2, 3, 4, 5, 8, 17):
            x = torch.randn(m, k, generator=g)
            bias = b if m % 2 else None
            assert_close_to_truth(ext.quant_linear(x, torch.from_numpy(raw), bias, t.type_id, isa), x, w, bias)


def test_compiled_kernel_refuses_bad_arguments():
    ext = extension()
    raw = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="GGML type 3 is not served"):
        ext.quant_linear(torch.zeros(1, 256), raw, None, 3, "avx2")
    with pytest.raises(RuntimeError, match="x has 512 columns; the weight rows hold 144 bytes"):
        ext.quant_linear(torch.zeros(1, 512), raw, None, 12, "avx2")
    with pytest.raises(RuntimeError, match="weight must be contiguous uint8"):
        ext.quant_linear(torch.zeros(1, 256), raw.to(torch.int8), None, 12, "avx2")
    with pytest.raises(RuntimeError, match="bias must be contiguous float32"):
        ext.quant_linear(torch.zeros(1, 256), raw, torch.zeros(3), 12, "avx2")


@pytest.mark.parametrize("backend", ["auto", "torch", "avx2"])
def test_linear_takes_the_kernel_for_few_rows_and_torch_beyond(backend):
    from kvstate import kernels

    m, w = _block_linear("Q4_K", 40, 512, bias=True, seed=6)
    ext = extension()
    for rows in (1, 7, MAX_ROWS + 1):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        before = sum(ext.quant_calls())
        with torch.no_grad(), kernels.backend(backend):
            y = m(x)
        ran = sum(ext.quant_calls()) - before
        assert ran == (1 if backend != "torch" and rows <= MAX_ROWS else 0), (backend, rows)
        ref = F.linear(x.double(), w.double(), m.bias.double())
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_fused_block_linears_project_like_each_alone():
    """`kernels.fused` concatenates rows of blocks of one type (GGUF's q/k/v, gate/up) into one call;
    linears of different block types (a Q4_K_M file's Q6_K v beside Q4_K q, k) become `BlockParts`,
    one call too, each member keeping its tensor; a float Linear beside blocks stays apart."""
    from kvstate.kernels.fused import BlockParts, fuse, project

    parts = [_block_linear("Q4_K", n, 512, bias=False, seed=20 + n)[0] for n in (16, 8, 40)]
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        alone = [m(x) for m in parts]
        group = fuse(*parts)
        assert group is not None and group.format == "Q4_K" and tuple(group.weight.shape) == (64, 2 * 144)
        for got, ref in zip(project(x, *parts), alone):
            assert torch.equal(got, ref)
        assert all(m.weight.data_ptr() == group.weight[i].data_ptr() for m, i in zip(parts, (0, 16, 24)))
    q6 = _block_linear("Q6_K", 8, 512, bias=False, seed=30)[0]
    assert fuse(Linear(512, 8, bias=False), q6) is None
    assert fuse(_block_linear("Q4_K", 8, 512, bias=True, seed=32)[0], q6) is None  # biases: per member
    ext = extension()
    mixed = [_block_linear(q, n, 512, bias=False, seed=40 + n)[0] for q, n in (("Q4_K", 24), ("Q6_K", 8), ("Q4_K", 3))]
    for rows in (1, 5, MAX_ROWS + 1):  # the compiled parts kernel; beyond MAX_ROWS each member alone
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            alone = [m(x) for m in mixed]
            group = fuse(*mixed)
            assert isinstance(group, BlockParts) and group.format == ("Q4_K", "Q6_K", "Q4_K")
            before = sum(ext.quant_calls())
            got = project(x, *mixed)
            assert sum(ext.quant_calls()) - before == (1 if rows <= MAX_ROWS else 0)  # beyond: tiles + GEMM
        for g, ref in zip(got, alone):
            assert torch.equal(g, ref)
    assert group.intact() and [m.weight.data_ptr() for m in mixed] == [w.data_ptr() for w in group.weights]
    mixed[1].weight = torch.nn.Parameter(mixed[1].weight.clone(), requires_grad=False)
    assert not group.intact()  # replaced since: project calls each member
    with torch.no_grad():
        assert torch.equal(project(x, *mixed)[1], mixed[1](x))
    group.remember()
    assert group.intact()


def test_compiled_parts_kernel_equals_each_part_on_each_isa():
    """`quant_linear_parts`: the rows of several block types stacked, split over the threads by bytes,
    equal to `quant_linear` on each part bit for bit (tiny parts, a part of one row, 1 to 9 x rows)."""
    ext = extension()
    specs = [("Q6_K", 300), ("Q4_K", 1), ("Q8_0", 40), ("Q5_K", 2), ("Q4_0", 130), ("Q4_K", 64)]
    raws = [torch.from_numpy(random_blocks(q, n, 768 // TYPES[q].block, seed=i)) for i, (q, n) in enumerate(specs)]
    types = [TYPES[q].type_id for q, _ in specs]
    g = torch.Generator().manual_seed(3)
    for isa in [i for i in ext.isas() if i != "amx"]:
        for m in (1, 4, 9):
            x = torch.randn(m, 768, generator=g)
            ref = torch.cat([ext.quant_linear(x, r, None, t, isa) for r, t in zip(raws, types)], 1)
            assert torch.equal(ext.quant_linear_parts(x, raws, types, isa), ref), (isa, m)
    with pytest.raises(RuntimeError, match="part 1's rows hold"):
        ext.quant_linear_parts(x, [raws[0], raws[1][:, :144]], types[:2])
    with pytest.raises(RuntimeError, match="one type per weight part"):
        ext.quant_linear_parts(x, raws, types[:2])


@pytest.mark.parametrize("qtype", sorted(TYPES))
def test_compiled_dequantizer_equals_gguf_bit_for_bit_on_each_isa(qtype):
    """`quant_dequantize` (the prefill GEMM's tiles) gives exactly gguf's weights, on each ISA."""
    ext = extension()
    raw = random_blocks(qtype, 37, 1280 // TYPES[qtype].block, seed=11)
    ref = quants.dequantize(raw, _gguf_type(qtype))
    for isa in [i for i in ext.isas() if i != "amx"]:
        got = ext.quant_dequantize(torch.from_numpy(raw), TYPES[qtype].type_id, isa)
        assert got.dtype == torch.float32 and np.array_equal(got.numpy(), ref), isa
    with pytest.raises(RuntimeError, match="rows of 100 bytes are not whole blocks"):
        ext.quant_dequantize(torch.zeros(2, 100, dtype=torch.uint8), 12)


@pytest.mark.parametrize("mode", ["bf16", "q8"])
def test_prefill_rows_follow_the_bf16_opt_in(mode):
    """Under set_activation_dtype("bf16"), and "q8" (llama.cpp's arithmetic, whose prefill is 8-bit),
    the GEMM path's tiles and x are rounded to bf16 on AVX512_BF16 CPUs; the default stays fp32 math on
    the exact weights, and bf16 weights keep fp32 math under "q8"."""
    from kvstate.kernels import activation, linear

    extension()
    if not activation.available():
        pytest.skip("no AVX512_BF16 on this CPU")
    m, w = _block_linear("Q6_K", 48, 512, bias=True, seed=12)
    x = torch.randn(MAX_ROWS + 3, 512, generator=torch.Generator().manual_seed(12))
    rounded = F.linear(x.bfloat16().double(), w.bfloat16().double(), m.bias.double())
    exact = F.linear(x.double(), w.double(), m.bias.double())
    if mode == "q8":
        wb = w.bfloat16()
        activation.set_activation_dtype("q8")
        try:
            yb = linear(x, wb).double()
        finally:
            activation.set_activation_dtype("fp32")
        truth = x.double() @ wb.double().T
        assert (yb - truth).abs().max() <= 1e-5 * truth.abs().max()
    with torch.no_grad():
        activation.set_activation_dtype(mode)
        try:
            y = m(x).double()
        finally:
            activation.set_activation_dtype("fp32")
        assert (y - rounded).abs().max() <= 1e-2 * rounded.abs().max()
        assert (y - exact).abs().max() > 1e-4 * exact.abs().max()  # x's rounding shows
        assert (m(x).double() - exact).abs().max() <= 1e-5 * exact.abs().max()
