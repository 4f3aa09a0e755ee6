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
