"""`kernels.decode`: each decode-step kernel against the torch code it replaces (norm.py, the conv
update, the recurrent gated delta rule, which the model tests hold to transformers), on awkward
sizes (dims not multiples of 8, batch 1..17, scattered slots, column views), with the kernel
checked to have run; and what goes to torch instead (autograd, prefill-sized, bf16, forced)."""

import pytest
import torch
import torch.nn.functional as F

from kvstate import kernels
from kvstate.kernels import decode as kdecode
from kvstate.layers.mlp import GatedMLP
from kvstate.layers.norm import GatedRMSNorm, RMSNorm
from kvstate.ops import causal_conv1d_update, recurrent_gated_delta_rule
from tests.kernels.conftest import extension

BATCHES = [1, 2, 5, 17]


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def column_view(rows: int, cols: int, g, extra: int = 5) -> torch.Tensor:
    """[rows, cols] as a column slice of a wider matrix (what `kernels.fused.project` hands over)."""
    return torch.randn(rows, cols + extra, generator=g)[:, extra:]


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dim", [7, 100, 1024])
def test_rms_norm(dim, offset):
    extension()
    g = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, 1e-6, offset=offset).requires_grad_(False)
    norm.weight.normal_(generator=g).mul_(0.3)
    for n in BATCHES:
        for x in (column_view(n, dim, g), torch.randn(n, 3, dim, generator=g), torch.randn(dim, generator=g)):
            with kernels.backend("torch"):
                ref = norm(x)
            assert kdecode.rms_norm(x, norm.weight, norm.eps, offset) is not None  # the kernel serves it
            y = norm(x)
            assert y.shape == x.shape and rel(y, ref) < 1e-6


@pytest.mark.parametrize("dim", [7, 1024])
def test_add_rms_norm(dim):
    """The residual add and the next norm in one call (`RMSNorm.add_forward`): both results as torch's."""
    extension()
    g = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, 1e-6, offset=1.0).requires_grad_(False)
    norm.weight.normal_(generator=g)
    for n in BATCHES:
        x, delta = torch.randn(n, dim, generator=g), column_view(n, dim, g)
        with kernels.backend("torch"):
            ref_sum, ref = norm.add_forward(x, delta)
        assert kdecode.add_rms_norm(x, delta, norm.weight, norm.eps, 1.0) is not None
        s, y = norm.add_forward(x, delta)
        assert torch.equal(s, ref_sum) and rel(y, ref) < 1e-6


def test_silu_mul():
    extension()
    g = torch.Generator().manual_seed(0)
    mlp = GatedMLP(12, 43).requires_grad_(False)
    for n in BATCHES:
        gate, up = column_view(n, 43, g) * 4, column_view(n, 43, g)
        assert rel(kdecode.silu_mul(gate, up), F.silu(gate) * up) < 1e-6
        x = torch.randn(n, 12, generator=g)
        with kernels.backend("torch"):
            ref = mlp(x)
        assert rel(mlp(x), ref) < 1e-6


@pytest.mark.parametrize("dim", [13, 128])
def test_gated_rms_norm(dim):
    extension()
    g = torch.Generator().manual_seed(dim)
    norm = GatedRMSNorm(dim, 1e-6).requires_grad_(False)
    norm.weight.normal_(generator=g)
    for n in BATCHES:
        x, z = torch.randn(n, 3, dim, generator=g), column_view(n * 3, dim, g).view(n, 3, dim) * 3
        with kernels.backend("torch"):
            ref = norm(x, z)
        assert kdecode.gated_rms_norm(x, z, norm.weight, norm.eps) is not None
        assert rel(norm(x, z), ref) < 1e-6


def test_gdn_gates():
    extension()
    g = torch.Generator().manual_seed(0)
    hv = 11
    A_log, dt_bias = torch.randn(hv, generator=g), torch.randn(hv, generator=g)
    for n in BATCHES:
        a, b = column_view(n, hv, g) * 12, column_view(n, hv, g) * 5  # a + dt_bias beyond softplus' threshold 20
        a[0, 0] = 30.0
        gk, bk = kdecode.gdn_gates(a, b, A_log, dt_bias)
        ref_g = -A_log.exp() * F.softplus(a + dt_bias)
        assert rel(gk, ref_g) < 1e-6 and rel(bk, torch.sigmoid(b)) < 1e-6


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("window", ["kernel", "kernel-1"])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("w_len", [4, 3])
def test_conv_update(window, bias, activation, w_len):
    """W = 4 with S = 4 runs 8 channels at a time (37 = 4 x 8 + 5 exercises the rest), the others per channel."""
    extension()
    g = torch.Generator().manual_seed(1)
    d, slots_total = 37, 23
    s_len = w_len if window == "kernel" else w_len - 1
    weight = torch.randn(d, w_len, generator=g)
    b = torch.randn(d, generator=g) if bias else None
    for n in BATCHES:
        pool = torch.randn(slots_total, d, s_len, generator=g)
        slots = torch.randperm(slots_total, generator=g)[:n]  # scattered, unordered
        x = column_view(n, d, g)
        ref_state = pool.index_select(0, slots)
        ref = causal_conv1d_update(x, ref_state, weight, b, activation=activation)
        before = pool.clone()
        y = kdecode.conv_update(x, pool, slots, weight, b, activation)
        assert rel(y, ref) < 1e-6
        assert torch.equal(pool.index_select(0, slots), ref_state)  # a shift: exact
        others = torch.ones(slots_total, dtype=torch.bool)
        others[slots] = False
        assert torch.equal(pool[others], before[others])  # no other slot touched


@pytest.mark.parametrize("l2,scale", [(True, None), (False, 0.3)])
@pytest.mark.parametrize("heads", [(3, 6, 20, 13), (2, 2, 128, 128), (1, 2, 9, 200)])  # 200: two column chunks
def test_gdn_recurrent(heads, l2, scale, gdn_isa):
    extension()
    h, hv, dk, dv = heads
    g = torch.Generator().manual_seed(dk)
    for n in BATCHES:
        pool = torch.randn(n + 9, hv, dk, dv, generator=g) * 0.1
        slots = torch.randperm(n + 9, generator=g)[:n]
        q, k = torch.randn(n, h, dk, generator=g), torch.randn(n, h, dk, generator=g)
        if not l2:
            k = F.normalize(k, dim=-1)
        v = torch.randn(n, hv, dv, generator=g)
        gate = -torch.rand(n, hv, generator=g) * 3
        beta = torch.rand(n, hv, generator=g)
        ref_pool = pool.clone()
        ref, _ = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], gate[:, None], beta[:, None],
                                            scale=scale, initial_state=ref_pool, state_indices=slots,
                                            inplace_final_state=True, use_qk_l2norm_in_kernel=l2)
        o = kdecode.gdn_recurrent(q, k, v, gate, beta, pool=pool, slots=slots, scale=scale, l2=l2)
        assert o.shape == (n, hv, dv)
        assert rel(o, ref[:, 0]) < 1e-5
        assert rel(pool, ref_pool) < 1e-6  # updated slots equal, the others untouched


def test_torch_serves_what_the_kernels_do_not(monkeypatch):
    extension()
    x, w = torch.randn(3, 16), torch.randn(16)
    assert kdecode.rms_norm(x, w, 1e-6) is not None
    with kernels.backend("torch"):  # forced, as by KVSTATE_KERNELS=torch
        assert kdecode.rms_norm(x, w, 1e-6) is None
    assert kdecode.rms_norm(torch.randn(kdecode.MAX_ROWS + 1, 16), w, 1e-6) is None  # prefill-sized
    assert kdecode.rms_norm(x.bfloat16(), w, 1e-6) is None
    wg = w.clone().requires_grad_(True)
    assert kdecode.rms_norm(x, wg, 1e-6) is None  # autograd records: the kernels have no backward
    with torch.no_grad():
        assert kdecode.rms_norm(x, wg, 1e-6) is not None
    monkeypatch.setattr(kdecode._ext, "_loaded", {"module": None, "reason": "not built"})
    assert kdecode.rms_norm(x, w, 1e-6) is None  # no extension
    norm = RMSNorm(16).requires_grad_(False)
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
