"""The fused Gated DeltaNet decode kernel (`kernels.decode.gdn_decode`) against the layer's torch
path: same outputs, same conv windows and states in the slots (scattered, some entries fresh),
batch 1..17, grouped value heads, dims not multiples of 8, with all threads as well as one."""

from types import SimpleNamespace

import pytest
import torch

from kvstate import kernels
from kvstate.kernels import _ext, threads
from kvstate.kernels import decode as kdecode
from kvstate.layers.gated_deltanet import GatedDeltaNet
from kvstate.models.batch import Batch
from tests.kernels.conftest import extension
from tests.kernels.test_decode_ops import rel


def layer(h, hv, dk, dv, seed=0) -> GatedDeltaNet:
    torch.manual_seed(seed)
    m = GatedDeltaNet(40, h, hv, dk, dv, conv_kernel=4).requires_grad_(False)
    for p in m.parameters():
        p.normal_().mul_(p.shape[-1] ** -0.5 if p.dim() == 2 else 0.5)
    m.A_log.uniform_(-1, 1)
    m.norm.weight.add_(1)
    return m


def pools(m, num_slots, window, g):
    s_len = m.conv_kernel if window == "kernel" else m.conv_kernel - 1
    return SimpleNamespace(conv=torch.randn(num_slots, m.conv_dim, s_len, generator=g),
                           state=torch.randn(num_slots, m.num_v_heads, m.head_k_dim, m.head_v_dim, generator=g) * 0.1)


def decode_batch(n, slots, fresh=()):
    ctx = [0 if i in fresh else 7 for i in range(n)]
    return Batch.build([1] * n, ctx, slots, [[i] for i in range(n)], 16)


class Spy:
    """Wraps the extension to count the calls of each op."""

    def __init__(self, ext, calls):
        self.ext, self.calls = ext, calls

    def __getattr__(self, name):
        fn = getattr(self.ext, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)

        return call


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("window", ["kernel", "kernel-1"])
@pytest.mark.parametrize("heads", [(3, 6, 20, 13), (2, 4, 128, 100)])
def test_fused_equals_torch(heads, window, wide, monkeypatch, gdn_isa):
    ext = extension()
    m = layer(*heads)
    g = torch.Generator().manual_seed(1)
    if wide:  # the big-state branch: all threads, the heads split over them
        monkeypatch.setattr(kdecode, "WIDE_STATE_BYTES", 0)
    calls = []
    monkeypatch.setattr(_ext, "_loaded", {"module": Spy(ext, calls), "reason": None})
    for n in (1, 3, 17):
        cache = pools(m, n + 6, window, g)
        slots = torch.randperm(n + 6, generator=g)[:n].tolist()
        batch = decode_batch(n, slots, fresh={1})
        x = torch.randn(n, 40, generator=g)
        ref_cache = SimpleNamespace(conv=cache.conv.clone(), state=cache.state.clone())
        calls.clear()
        with torch.inference_mode():
            with kernels.backend("torch"):
                ref = m(x, batch, ref_cache)
            assert calls == []
            with threads.small_ops_serial():
                y = m(x, batch, cache)
        assert calls.count("gdn_decode") == 1, calls  # the fused kernel ran, once
        assert rel(y, ref) < 1e-5
        assert rel(cache.state, ref_cache.state) < 1e-6
        assert torch.equal(cache.conv, ref_cache.conv)


def test_mixed_step_uses_the_piecewise_kernels(monkeypatch):
    """A step with a prefill entry runs the ops one by one: decode entries still get the conv and
    recurrent kernels, the prefill entry torch's chunk form; the result equals the torch path."""
    ext = extension()
    m = layer(3, 6, 20, 13)
    g = torch.Generator().manual_seed(2)
    cache = pools(m, 8, "kernel", g)
    batch = Batch.build([1, 5, 1], [4, 0, 9], [6, 2, 0], [[0], [1], [2]], 16)
    x = torch.randn(7, 40, generator=g)
    ref_cache = SimpleNamespace(conv=cache.conv.clone(), state=cache.state.clone())
    calls = []
    with torch.inference_mode():
        with kernels.backend("torch"):
            ref = m(x, batch, ref_cache)
        monkeypatch.setattr(_ext, "_loaded", {"module": Spy(ext, calls), "reason": None})
        y = m(x, batch, cache)
    assert "gdn_decode" not in calls and {"conv_update", "gdn_recurrent", "gated_rms_norm", "gdn_gates"} <= set(calls)
    assert rel(y, ref) < 1e-5
    assert rel(cache.state, ref_cache.state) < 1e-6
    assert torch.equal(cache.conv, ref_cache.conv)


def test_fused_serves_only_what_it_can():
    extension()
    m = layer(3, 6, 20, 13)
    g = torch.Generator().manual_seed(3)
    cache = pools(m, 4, "kernel", g)
    batch = decode_batch(2, [3, 1])
    qkv, z = torch.randn(2, m.conv_dim, generator=g), torch.randn(2, m.value_dim, generator=g)
    a, b = torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)
    args = dict(conv_pool=cache.conv, conv_weight=m.conv_weight, state_pool=cache.state, group=batch.groups[0],
                A_log=m.A_log, dt_bias=m.dt_bias, norm_weight=m.norm.weight, norm_eps=m.norm.eps, num_k_heads=3)
    assert kdecode.gdn_decode(qkv, z, a, b, **args) is not None
    with kernels.backend("torch"):
        assert kdecode.gdn_decode(qkv, z, a, b, **args) is None
    assert kdecode.gdn_decode(qkv, z, a, b, **{**args, "state_pool": cache.state.transpose(2, 3)}) is None
    with pytest.raises(RuntimeError, match="slot 4 outside"):
        kdecode.gdn_decode(qkv, z, a, b, **{**args, "group": decode_batch(2, [4, 1]).groups[0]})
