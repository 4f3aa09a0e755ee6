"""int8 weights with per-row scales (weight-only quantization, `kernels.quant`) in the compiled
skinny GEMM, against the fp64 truth scale[n] * sum_k q[n, k] x[m, k] (+ bias): awkward shapes, 1 to
17 rows, every ISA this CPU has ("amx" sends int8 to AVX-512), each register tile, non-contiguous x;
the dispatcher (kernels and torch fallback) against F.linear on the dequantized weights; and the
quantizer's rounding bound."""

import pytest
import torch
import torch.nn.functional as F

from kvstate import kernels
from kvstate.kernels.quant import QMAX, dequantize, quantize_rows
from tests.kernels.conftest import assert_close_to_truth, extension
from tests.kernels.test_gemv import SHAPES, TILES, row_class


def _int8(n, k, g):
    q = torch.randint(-QMAX, QMAX + 1, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.02 + 1e-3
    return q, scale, q.double() * scale.double()[:, None]  # the weights the kernel multiplies by


@pytest.mark.parametrize("n,k", SHAPES)
def test_against_truth_every_isa_and_row_count(n, k):
    ext = extension()
    g = torch.Generator().manual_seed(n * 1000 + k)
    q, scale, w = _int8(n, k, g)
    b = torch.randn(n, generator=g)
    for isa in ext.isas():
        for m in range(1, 18):
            x = torch.randn(m, k, generator=g)
            bias = b if m % 2 else None
            assert_close_to_truth(ext.linear(x, q, bias, isa, scale=scale), x, w, bias)


@pytest.mark.parametrize("n,k", [(37, 1000), (130, 33), (1031, 2049)])
def test_each_register_tile_runs_and_is_exact(n, k):
    """int8 runs fp32's register tiles (the weights are widened as they are loaded)."""
    ext = extension()
    g = torch.Generator().manual_seed(n + k)
    q, scale, w = _int8(n, k, g)
    for isa in [i for i in ext.isas() if i in TILES]:
        for m in range(1, 18):
            x = torch.randn(m, k, generator=g)
            for narrow in (False, True):
                y = ext.linear(x, q, None, isa, narrow, scale=scale)
                assert ext.last_tile() == TILES[isa]["fp32"][row_class(m, narrow)], (isa, m, narrow)
                assert_close_to_truth(y, x, w, None)


def test_non_contiguous_x_and_bad_arguments():
    ext = extension()
    g = torch.Generator().manual_seed(3)
    q, scale, w = _int8(45, 70, g)
    for isa in ext.isas():
        x = torch.randn(6, 140, generator=g)[:, ::2]
        assert_close_to_truth(ext.linear(x, q, None, isa, scale=scale), x, w, None)
    x = torch.randn(2, 70)
    with pytest.raises(RuntimeError, match="need their per-row scale"):
        ext.linear(x, q)
    with pytest.raises(RuntimeError, match="need their per-row scale"):
        ext.linear(x, torch.randn(45, 70), scale=scale)  # a scale for fp32 weights
    with pytest.raises(RuntimeError, match="scale must be contiguous float32"):
        ext.linear(x, q, scale=scale[:44])
    with pytest.raises(RuntimeError, match="scale must be contiguous float32"):
        ext.linear(x, q, scale=scale.double())


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("rows", [1, 7, 100])  # the kernels up to 64 rows, torch's GEMM beyond
def test_dispatch_equals_linear_on_dequantized_weights(backend, rows):
    g = torch.Generator().manual_seed(rows)
    q, scale = quantize_rows(torch.randn(96, 200, generator=g))
    b = torch.randn(96, generator=g)
    x = torch.randn(rows, 200, generator=g)
    ref = F.linear(x, dequantize(q, scale), b)
    with kernels.backend(backend):
        y = kernels.linear(x, q, b, scale)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    with pytest.raises(ValueError, match="needs its per-row scale"):
        kernels.linear(x, q, b)


def test_quantize_rows_rounds_to_the_nearest_step():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(33, 50, generator=g) * torch.logspace(-3, 2, 33)[:, None]  # rows of very different size
    w[5] = 0  # an all-zero row
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (33,)
    assert int(q.abs().max()) == QMAX and torch.equal(q[5], torch.zeros(50, dtype=torch.int8))
    err = (dequantize(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-6)).all()  # within half a step of every weight
    assert (q.abs().amax(dim=1)[torch.arange(33) != 5] == QMAX).all()  # each row's largest weight hits 127


@pytest.mark.parametrize("n,k", [(32, 32), (37, 100), (96, 1000), (33, 2049)])
def test_amx_serves_3_or_more_rows(n, k):
    """On AMX machines int8 weights are widened to bf16 as they are staged (exact) and each row's sum
    is scaled: one pass over the weights up to 32 rows, the K % 32 tail and the bias included."""
    ext = extension()
    if "amx" not in ext.isas():
        pytest.skip("this CPU has no AMX")
    g = torch.Generator().manual_seed(n * k)
    q, scale, w = _int8(n, k, g)
    b = torch.randn(n, generator=g)
    for m in (3, 8, 17, 32, 40):
        ext.linear(torch.randn(40, 64), torch.randn(64, 64).bfloat16(), None, "amx")  # 2 passes
        x = torch.randn(m, k, generator=g)
        y = ext.linear(x, q, b, "amx", scale=scale)
        assert ext.last_amx_passes() == (1 if m <= 32 else 2), m
        assert_close_to_truth(y, x, w, b)
