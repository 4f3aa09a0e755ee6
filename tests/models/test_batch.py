"""The step's metadata (`kvstate.models.batch.Batch`): host lengths, KV indices, modes and groups,
and logits for the sampled rows only."""

import pytest
import torch

from kvstate.models.batch import Batch
from kvstate.models.generate import contiguous_caches, forward_logits
from tests.engine.test_engine import tiny_qwen3_5
from tests.models.checks import random_ids, rel_err, save_and_load


def test_build_gives_positions_kv_indices_modes_and_groups():
    tables = [[3, 1], [0], [2, 5, 4]]
    batch = Batch.build([1, 3, 1], [5, 0, 9], [2, 0, 1], tables, 4)
    assert (batch.query_lens, batch.context_lens, batch.kv_lens) == ([1, 3, 1], [5, 0, 9], [6, 3, 10])
    assert batch.token_offsets == [0, 1, 4, 5] and batch.cu_seqlens.tolist() == [0, 1, 4, 5]
    assert batch.positions.tolist() == [5, 0, 1, 2, 9]
    want = [tables[i][p // 4] * 4 + p % 4 for i, p in [(0, 5), (1, 0), (1, 1), (1, 2), (2, 9)]]
    assert batch.kv_indices.tolist() == want
    assert batch.block_tables.tolist() == [[3, 1, -1], [0, -1, -1], [2, 5, 4]]
    assert batch.modes == ["decode", "prefill", "decode"] and not batch.decode_only
    decode, prefill = batch.groups
    got = (decode.mode, decode.entries, decode.rows.tolist(), decode.slots.tolist())
    assert got == ("decode", [0, 2], [0, 4], [2, 1])
    assert decode.fresh_slots is None and prefill.fresh_slots.tolist() == [0]
    assert (prefill.rows, prefill.cu_seqlens.tolist(), prefill.num_tokens) == (slice(1, 4), [0, 3], 3)
    assert batch.logits_indices.tolist() == [0, 3, 4]


def test_build_rejects_bad_steps():
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        Batch.build([4], [5], [0], [[0, 1]], 4)
    with pytest.raises(ValueError, match="exactly one token"):
        Batch.build([2], [0], [0], [[0]], 4, modes=["decode"])
    with pytest.raises(ValueError, match="does not go with"):
        Batch.build([2], [0], [0], [[0]], 4, logits="all", sample_rows=[0])


@torch.inference_mode()
def test_the_model_returns_logits_for_the_sampled_rows_only(tmp_path):
    """A chunked prefill's middle chunk is not sampled: only the other entries' last tokens reach the
    LM head, in the order asked for, equal to the full forward's rows."""
    model, _ = save_and_load(tiny_qwen3_5(), tmp_path)
    seqs = [random_ids(101, n, 30 + i) for i, n in enumerate([9, 12, 5])]
    full = forward_logits(model, seqs)
    caches = contiguous_caches(model, 3, 16)
    batch = Batch.build([9, 12, 5], [0, 0, 0], [0, 1, 2], [[0], [1], [2]], 16, sample_rows=[2, 0])
    logits = model(torch.tensor([t for s in seqs for t in s]), batch, caches)
    assert logits.shape == (2, 101)
    assert rel_err(logits, torch.stack([full[2][-1], full[0][-1]])) <= 1e-5
    batch = Batch.build([3], [0], [0], [[0]], 16, sample_rows=[])
    assert model(torch.tensor(seqs[0][:3]), batch, caches).shape == (0, 101)


def test_tensors_follow_the_device_asked_for():
    batch = Batch.build([2, 1], [0, 3], [0, 1], [[0], [1]], 4, device="meta")
    tensors = [batch.cu_seqlens, batch.positions, batch.state_slots, batch.block_tables, batch.kv_indices,
               batch.logits_indices] + [t for g in batch.groups for t in (g.cu_seqlens, g.slots)]
    assert all(t.device.type == "meta" for t in tensors)


@pytest.mark.parametrize("rows", [[2], [0, 3, 4], [1, 2, 3, 5]])
def test_decode_at_equals_a_built_decode_step_at_those_rows(rows):
    """A drafter's one-token-per-row step at positions the target just computed (verify, decode and
    prefill entries) is the step `Batch.build` makes of them, sliced from the target's step."""
    tables = [[3, 1], [0], [2, 5, 4]]
    for modes in (["verify", "decode", "verify"], ["prefill", "decode", "prefill"]):
        step = Batch.build([3, 1, 2], [5, 0, 9], [2, 0, 1], tables, 4, modes=modes)
        entry = [0, 0, 0, 1, 2, 2]
        pos = [5, 6, 7, 0, 9, 10]
        want = Batch.build([1] * len(rows), [pos[r] for r in rows], [[2, 0, 1][entry[r]] for r in rows],
                           [tables[entry[r]] for r in rows], 4)
        got = step.decode_at(rows)
        assert (got.query_lens, got.context_lens, got.kv_lens, got.token_offsets, got.modes) == \
            (want.query_lens, want.context_lens, want.kv_lens, want.token_offsets, want.modes)
        for name in ("cu_seqlens", "positions", "state_slots", "kv_indices", "logits_indices"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        width = want.block_tables.shape[1]  # the step's tables may be wider, padded with -1
        assert torch.equal(got.block_tables[:, :width], want.block_tables)
        assert (got.block_tables[:, width:] == -1).all() and got.decode_only and got.verify_group is None
        (g,), (w,) = got.groups, want.groups
        assert (g.mode, g.entries, g.num_tokens) == (w.mode, w.entries, w.num_tokens)
        assert torch.equal(g.slots, w.slots) and torch.equal(g.cu_seqlens, w.cu_seqlens)
        assert (g.fresh_slots is None) == (w.fresh_slots is None)
        assert g.fresh_slots is None or torch.equal(g.fresh_slots, w.fresh_slots)


def test_side_by_side_mixers_get_both_caches_in_one_layer():
    """A block with attention and Mamba-2 side by side: its pool holds K/V blocks and a state slot, the bytes
    the cache spec (and so the planner) gives."""
    from kvstate.cache.pools import allocate_pools
    from kvstate.cache.spec import cache_spec
    from kvstate.families import read_plan
    from tests.parallel.test_plan import SIDE_BY_SIDE

    spec = cache_spec(read_plan(SIDE_BY_SIDE), kv_dtype="float32", state_dtype="float32", conv_dtype="float32")
    assert [e.kind for e in spec.entries] == ["attention", "mamba2"] * 2
    pools = allocate_pools(spec, num_blocks=3, block_size=4, num_slots=2)
    assert all(p.k is not None and p.v is not None and p.state is not None and p.conv is not None for p in pools)
    assert sum(p.nbytes() for p in pools) == 3 * 4 * spec.kv_bytes_per_token + 2 * spec.state_bytes
