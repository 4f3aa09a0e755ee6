"""Speculative decoding's verify step on the per-token kernels (`kernels.decode.gdn_verify` and
`attention_decode` with a block table per token) against the layers' torch path: entries of
several tokens (the last known token and the drafts) beside plain decode entries, scattered slots
and blocks; the same outputs, the same state and conv window after every token for the rollback
(the kernel's pools hold each entry's first token's, torch's its last's), and the same pools once
`keep_states` has rolled entries back."""

from types import SimpleNamespace

import pytest
import torch

from kvstate import kernels
from kvstate.kernels import _ext
from kvstate.kernels import decode as kdecode
from kvstate.layers.recurrence import keep_states
from kvstate.models.batch import Batch
from tests.kernels import test_decode_attention as attn
from tests.kernels.conftest import extension
from tests.kernels.test_decode_gdn import Spy, layer, pools
from tests.kernels.test_decode_ops import rel


def verify_batch(lens: list[int], ctx: list[int], slots: list[int], tables: list[list[int]], block: int) -> Batch:
    modes = ["verify" if q > 1 else "decode" for q in lens]
    return Batch.build(lens, ctx, slots, tables, block, modes=modes)


def clone(ns: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(**{k: v.clone() for k, v in vars(ns).items()})


@pytest.mark.parametrize("window", ["kernel", "kernel-1"])
@pytest.mark.parametrize("heads", [(3, 6, 20, 13), (2, 4, 128, 100)])
def test_gdn_verify_equals_torch(heads, window, monkeypatch, gdn_isa):
    ext = extension()
    m = layer(*heads)
    g = torch.Generator().manual_seed(4)
    calls = []
    monkeypatch.setattr(_ext, "_loaded", {"module": Spy(ext, calls), "reason": None})
    for lens in ([5], [3, 1, 9], [1, 2, 1, 4]):
        n = len(lens)
        cache = pools(m, n + 5, window, g)
        slots = torch.randperm(n + 5, generator=g)[:n].tolist()
        ctx = [0 if q == 1 and i == n - 1 and n > 1 else 6 + i for i, q in enumerate(lens)]  # a fresh decode entry
        batch, ref_batch = (verify_batch(lens, ctx, slots, [[i] for i in range(n)], 64) for _ in range(2))
        x = torch.randn(sum(lens), 40, generator=g)
        ref_cache = clone(cache)
        calls.clear()
        with torch.inference_mode():
            with kernels.backend("torch"):
                ref = m(x, ref_batch, ref_cache)
            y = m(x, batch, cache)
        assert calls.count("gdn_verify") == 1, calls  # the per-token kernel ran, once for the layer
        assert rel(y, ref) < 1e-5
        # the states after every token: the kernel keeps the whole step but each entry's first token
        # (its pools hold that one), torch each verify group's rows (its pools the last token's)
        offsets = ref_batch.token_offsets
        verify = [i for i in range(n) if lens[i] > 1]
        verify_rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in verify])
        later = torch.cat([torch.arange(offsets[i] + 1, offsets[i + 1]) for i in verify])
        firsts = [offsets[i] for i in verify]
        ref_later = [r for r, t in enumerate(verify_rows.tolist()) if t not in firsts]
        ref_first = [r for r, t in enumerate(verify_rows.tolist()) if t in firsts]
        for (pool, _, states, at_first), (ref_pool, _, ref_states, ref_at_first) in zip(
                sorted(batch.rollback, key=lambda r: r[0].dim()), sorted(ref_batch.rollback, key=lambda r: r[0].dim())):
            assert at_first and not ref_at_first
            assert rel(states.index_select(0, later), ref_states[ref_later]) < 1e-5
            assert rel(pool[torch.tensor(slots)[verify]], ref_states[ref_first].to(pool.dtype)) < 1e-5
        decode = [slots[i] for i in range(n) if lens[i] == 1]  # decode entries: updated in place by both
        assert rel(cache.state[decode], ref_cache.state[decode]) < 1e-5
        assert torch.equal(cache.conv[decode], ref_cache.conv[decode])
        keep = {i: 1 + i % lens[i] for i in range(n) if lens[i] > 1}  # some keep all their tokens, some one
        keep_states(batch, keep)
        keep_states(ref_batch, keep)
        assert rel(cache.state, ref_cache.state) < 1e-5 and torch.equal(cache.conv, ref_cache.conv)


def test_gdn_verify_keeps_the_first_tokens_state():
    """Keeping one token (every draft rejected) leaves the state a plain decode of that token leaves."""
    extension()
    m = layer(3, 6, 20, 13)
    g = torch.Generator().manual_seed(5)
    cache = pools(m, 3, "kernel", g)
    plain = clone(cache)
    x = torch.randn(4, 40, generator=g)
    with torch.inference_mode():
        batch = verify_batch([4], [9], [2], [[0]], 64)
        y = m(x, batch, cache)
        keep_states(batch, {0: 1})
        y1 = m(x[:1], Batch.build([1], [9], [2], [[0]], 64), plain)
    assert rel(y[:1], y1) < 1e-5  # (the projections of 4 rows and of 1 may round differently)
    assert rel(cache.state, plain.state) < 1e-5 and rel(cache.conv, plain.conv) < 1e-6


def test_gdn_verify_checks_its_input():
    extension()
    m = layer(3, 6, 20, 13)
    g = torch.Generator().manual_seed(6)
    cache = pools(m, 4, "kernel", g)
    qkv, z = torch.randn(3, m.conv_dim, generator=g), torch.randn(3, m.value_dim, generator=g)
    a, b = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    args = dict(conv_pool=cache.conv, conv_weight=m.conv_weight, state_pool=cache.state, A_log=m.A_log,
                dt_bias=m.dt_bias, norm_weight=m.norm.weight, norm_eps=m.norm.eps, num_k_heads=3)
    ok = verify_batch([3], [5], [1], [[0]], 64).verify_group
    assert kdecode.gdn_verify(qkv, z, a, b, group=ok, **args) is not None
    with kernels.backend("torch"):
        assert kdecode.gdn_verify(qkv, z, a, b, group=ok, **args) is None
    with pytest.raises(RuntimeError, match="slot 4 outside"):
        kdecode.gdn_verify(qkv, z, a, b, group=verify_batch([3], [5], [4], [[0]], 64).verify_group, **args)
    with pytest.raises(RuntimeError, match="cu_seqlens must run from 0 to 3"):
        kdecode.gdn_verify(qkv, z, a, b, group=verify_batch([2], [5], [1], [[0]], 64).verify_group, **args)


@pytest.mark.parametrize("gated", [True, False])
def test_attention_verify_equals_torch(gated, monkeypatch):
    """Each drafted token attends to the context and the drafts before it (causal inside the step)."""
    ext = extension()
    m = attn.layer(gated)
    g = torch.Generator().manual_seed(7)
    calls = []
    monkeypatch.setattr(_ext, "_loaded", {"module": Spy(ext, calls), "reason": None})
    for lens in ([5], [3, 1, 9], [1, 6]):
        n = len(lens)
        ctx = torch.randint(1, 30, (n,), generator=g).tolist()
        free = torch.randperm(200, generator=g).tolist()
        tables = [[free.pop() for _ in range((c + q) // attn.BLOCK + 1)] for c, q in zip(ctx, lens)]
        batch = verify_batch(lens, ctx, list(range(n)), tables, attn.BLOCK)
        cache = SimpleNamespace(k=torch.randn(200, attn.BLOCK, 2, 20, generator=g),
                                v=torch.randn(200, attn.BLOCK, 2, 20, generator=g))
        attn.check_against_torch(m, torch.randn(sum(lens), 36, generator=g), batch, cache, calls)


def test_a_step_with_a_prefill_entry_has_no_verify_group():
    batch = Batch.build([3, 4], [5, 0], [0, 1], [[0, 1], [2]], 8, modes=["verify", "prefill"])
    assert batch.verify_group is None and batch.token_tables is None
    batch = Batch.build([3, 1], [5, 2], [0, 1], [[0, 1], [2]], 8, modes=["verify", "decode"])
    assert batch.verify_group.entries == [0, 1] and batch.token_tables.tolist() == [[0, 1]] * 3 + [[2, -1]]


def test_keep_states_copies_the_kept_rows_in_one_call_like_torch(monkeypatch):
    """`keep_states` writes each entry's kept row into its slot of every pool through one compiled
    `copy_rows` call, the same bytes torch's row copies give; rows kept whole or at the pool's own
    token are not written; a bf16 pool (dtypes differ) goes through torch."""
    ext = extension()
    calls = []
    real = ext.copy_rows
    monkeypatch.setattr(ext, "copy_rows", lambda *a: calls.append(len(a[0])) or real(*a))
    g = torch.Generator().manual_seed(0)
    lens, slots = [3, 1, 4], [2, 0, 1]
    for dtype in (torch.float32, torch.bfloat16):
        pools = [torch.randn(4, 2, 3, 5, generator=g).to(dtype), torch.randn(4, 6, 3, generator=g).to(dtype)]
        states = [torch.randn(8, 2, 3, 5, generator=g), torch.randn(8, 6, 3, generator=g)]
        runs = {}
        for backend in ("auto", "torch"):
            ps = [p.clone() for p in pools]
            b = verify_batch(lens, [5, 9, 2], slots, [[0], [1], [2]], 16)
            # the first pool holds each entry's state after its first token, the second after its last
            b.rollback = [(p, b.verify_group, s, first) for p, s, first in zip(ps, states, (True, False))]
            calls.clear()
            with kernels.backend(backend):
                keep_states(b, {0: 2, 2: 4})
            assert b.rollback == []
            assert calls == ([3] if backend == "auto" and dtype == torch.float32 else [])
            runs[backend] = ps
        for got, ref in zip(runs["auto"], runs["torch"]):
            assert torch.equal(got, ref)
        first, last = runs["auto"]
        # entry 0 (slot 2) keeps 2 of 3: row 1 in both pools; entry 2 (slot 1, rows 4..7) keeps all 4:
        # the first-token pool gets row 7, the all-tokens pool stays; entry 1 (slot 0) decoded one token
        assert torch.equal(first[2], states[0][1].to(dtype)) and torch.equal(last[2], states[1][1].to(dtype))
        assert torch.equal(first[1], states[0][7].to(dtype)) and torch.equal(last[1], pools[1][1])
        assert torch.equal(first[0], pools[0][0]) and torch.equal(last[0], pools[1][0])


def test_copy_rows_refuses_rows_outside_and_mismatched_rows():
    ext = extension()
    dst, src = torch.zeros(3, 4), torch.arange(8.0).view(2, 4)
    ext.copy_rows([dst], [2], [src], [1])
    assert torch.equal(dst[2], src[1]) and not dst[:2].any()
    with pytest.raises(RuntimeError, match="row 3 of 3"):
        ext.copy_rows([dst], [3], [src], [0])
    with pytest.raises(RuntimeError, match="rows of 4 and 2"):
        ext.copy_rows([dst], [0], [torch.zeros(2, 2)], [0])
    with pytest.raises(RuntimeError, match="one dtype"):
        ext.copy_rows([dst], [0], [src.double()], [0])
    with pytest.raises(RuntimeError, match="one entry per copy"):
        ext.copy_rows([dst], [0, 1], [src], [0])
