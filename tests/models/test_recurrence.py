"""The one recurrence path of the linear mixers (kvstate/layers/recurrence.py), layer by layer.

A step that mixes decodes (one token after a cached context) with prefill chunks must equal
running every sequence apart: decode entries through the recurrent op, updating their slots in
place, prefill entries through the chunk op. Mamba-2 tells the two ops apart: its chunked scan
clamps dt to dt_limit and its decode step does not (as transformers and mamba_ssm), so a step
that runs a decode through the chunk path gives another output.
"""

import math

import pytest
import torch

from kvstate.cache.pools import LayerCache
from kvstate.config.options import ModelOptions
from kvstate.config.plan import GatedDeltaNetSpec, KDASpec, Mamba1Spec, Mamba2Spec
from kvstate.models.batch import Batch
from kvstate.models.build import mixer_class
from tests.models.checks import redraw_weights, rel_err

HIDDEN = 32
SPECS = {
    "gated_deltanet": GatedDeltaNetSpec(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8, conv_kernel=4),
    "kda": KDASpec(num_heads=2, head_dim=16, conv_kernel=4),
    # dt_limit bites: softplus(dt + dt_bias) often falls under 0.5 with redraw_weights' dt_bias in (-2, 0)
    "mamba2": Mamba2Spec(num_heads=4, head_dim=8, d_state=16, n_groups=2, conv_kernel=4),
    "mamba1": Mamba1Spec(d_inner=48, d_state=8, conv_kernel=4, dt_rank=4),
}
OPTIONS = ModelOptions(mixer={"mamba2": {"dt_limit": (0.5, math.inf), "chunk_size": 8}})
NUM_SLOTS = 5


def layer_and_pools(kind: str, window: str = "kernel"):
    spec = SPECS[kind]
    layer = mixer_class(spec).from_spec(spec, HIDDEN, OPTIONS).eval()
    redraw_weights(layer, 3)
    cache = LayerCache(state=torch.zeros(NUM_SLOTS, *spec.state_shape()),
                       conv=torch.zeros(NUM_SLOTS, *spec.conv_shape(window)))
    return layer, cache


def copy(cache: LayerCache) -> LayerCache:
    return LayerCache(state=cache.state.clone(), conv=cache.conv.clone())


def run(layer, cache, entries):
    """entries: (tokens [q, hidden], context_len, slot) -> output [sum q, hidden]."""
    batch = Batch.build([len(x) for x, _, _ in entries], [c for _, c, _ in entries], [s for _, _, s in entries],
                        [[0]] * len(entries), 64)
    return layer(torch.cat([x for x, _, _ in entries]), batch, cache)


@pytest.mark.parametrize("window", ["kernel", "kernel-1"])
@pytest.mark.parametrize("kind", list(SPECS))
@torch.inference_mode()
def test_mixed_step_equals_each_sequence_apart(kind, window):
    layer, cache = layer_and_pools(kind, window)
    g = torch.Generator().manual_seed(0)
    x = lambda n: torch.randn(n, HIDDEN, generator=g)  # noqa: E731
    # caches to continue from: slot 3 holds 7 tokens, slot 1 holds 4 (slots 0 and 4 hold stale garbage)
    run(layer, cache, [(x(7), 0, 3), (x(4), 0, 1)])
    cache.state[0], cache.conv[0], cache.state[4], cache.conv[4] = 5.0, 5.0, -3.0, -3.0
    # decodes and prefills interleaved: decode, fresh prefill (stale slot), decode, fresh prompt of one
    # token (a decode entry on a stale slot), prefill
    entries = [(x(1), 7, 3), (x(6), 0, 0), (x(1), 4, 1), (x(1), 0, 4), (x(5), 0, 2)]
    apart_cache = copy(cache)
    apart = torch.cat([run(layer, apart_cache, [e]) for e in entries])
    mixed = run(layer, cache, entries)
    assert rel_err(mixed, apart) <= 1e-5, rel_err(mixed, apart)
    for key in ("state", "conv"):
        assert rel_err(getattr(cache, key), getattr(apart_cache, key)) <= 1e-5, key


@pytest.mark.parametrize("kind", list(SPECS))
@torch.inference_mode()
def test_decode_runs_the_recurrent_op_on_the_pool_and_prefill_the_chunk_op(kind, monkeypatch):
    """Every mixer (Mamba-1 too) hands decode entries (one token each) to its recurrent op, which
    updates the slots of the pool itself, and prefill entries to its chunk op with their own cu_seqlens."""
    import importlib

    from kvstate.layers.recurrence import RecurrentOps

    layer, cache = layer_and_pools(kind)
    module = importlib.import_module(type(layer).__module__)
    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            first = next(iter(kwargs.values())) if not args else args[0]
            calls.append((name, tuple(first.shape[:2]), kwargs.get("cu_seqlens"), kwargs.get("initial_state")))
            return fn(*args, **kwargs)
        return wrapped

    ops = module.OPS
    monkeypatch.setattr(module, "OPS", RecurrentOps(spy("chunk", ops.chunk), spy("recurrent", ops.recurrent)))
    g = torch.Generator().manual_seed(1)
    run(layer, cache, [(torch.randn(1, HIDDEN, generator=g), 3, 2), (torch.randn(6, HIDDEN, generator=g), 0, 0),
                       (torch.randn(1, HIDDEN, generator=g), 5, 4)])
    (r_name, r_shape, _, r_state), (c_name, c_shape, c_cu, _) = calls
    assert (r_name, r_shape, c_name, c_shape, c_cu.tolist()) == ("recurrent", (2, 1), "chunk", (1, 6), [0, 6])
    assert r_state is cache.state


@pytest.mark.parametrize("indices", [None, [4, 0, 2]])
@torch.inference_mode()
def test_selective_scan_decode_updates_the_state_pool(indices):
    """recurrent_selective_scan takes the state API of every recurrent form: `state_indices` rows of a
    pool as initial states, `inplace_final_state` writing the final states there (other rows untouched)."""
    from kvstate.ops import recurrent_selective_scan

    g = torch.Generator().manual_seed(2)
    n, d, s = 3, 12, 4
    u, delta, z = (torch.randn(n, 1, d, generator=g) for _ in range(3))
    B, C = torch.randn(n, 1, s, generator=g), torch.randn(n, 1, s, generator=g)
    A = -torch.rand(d, s, generator=g)
    pool = torch.randn(5 if indices else n, d, s, generator=g)
    rows = torch.tensor(indices) if indices else torch.arange(n)
    want_y, want_h = recurrent_selective_scan(u, delta, A, B, C, z=z, initial_state=pool[rows],
                                              output_final_state=True)
    before = pool.clone()
    y, h = recurrent_selective_scan(u, delta, A, B, C, z=z, initial_state=pool, inplace_final_state=True,
                                    state_indices=None if indices is None else rows)
    assert h is pool and torch.equal(y, want_y) and torch.equal(pool[rows], want_h)
    others = [i for i in range(pool.shape[0]) if i not in rows.tolist()]
    assert torch.equal(pool[others], before[others])
