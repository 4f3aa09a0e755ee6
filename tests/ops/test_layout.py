"""The shared pieces every op walks a batch with: sequence bounds (kvstate/ops/_common.py), the
chunk and scan layouts (kvstate/ops/_layout.py) and the one input preparation (_inputs.py)."""

from __future__ import annotations

import pytest
import torch

from kvstate.ops._common import seq_bounds
from kvstate.ops._inputs import prepare
from kvstate.ops._layout import chunk_layout, gather, scan_gather, scan_layout, unchunk

LENS = [5, 0, 70, 1, 33, 70]


def _bounds(lens):
    starts = torch.tensor([0] + lens).cumsum(0)[:-1].tolist()
    return starts, lens


def test_seq_bounds_batch_and_packed():
    assert seq_bounds(3, 4, None) == ([0, 4, 8], [4, 4, 4])
    assert seq_bounds(1, 9, torch.tensor([0, 2, 2, 9])) == ([0, 2, 2], [2, 0, 7])
    assert seq_bounds(0, 5, None) == ([], [])


@pytest.mark.parametrize("chunk", [1, 8, 32])
def test_chunk_layout_covers_every_token_once_running_sequences_a_prefix(chunk):
    starts, lens = _bounds(LENS)
    lay = chunk_layout(lens, starts, chunk, torch.device("cpu"))
    order = lay.order.tolist()
    counts = [-(-n // chunk) for n in lens]
    assert [counts[i] for i in order] == sorted(counts, reverse=True)  # longest first
    assert order == sorted(range(len(lens)), key=lambda i: -counts[i])  # stable among equals
    seen = []
    for j, (first, m) in enumerate(lay.steps):
        assert m == sum(c > j for c in counts)  # the sequences with a chunk j: a prefix of the order
        for r in range(m):
            seq, toks = order[r], lay.tok[first + r][lay.valid[first + r]].tolist()
            assert toks == list(range(starts[seq] + j * chunk, starts[seq] + min(lens[seq], (j + 1) * chunk)))
            seen += toks
    assert sorted(seen) == list(range(sum(lens)))
    assert lay.identity == (order == list(range(len(lens))))
    x = torch.arange(sum(lens), dtype=torch.float32)[:, None, None].expand(-1, 2, 3)  # [tot, H, D]
    chunks = gather(x, lay, 0, lay.slots, torch.float32)  # [slots, H, C, D], padding zeroed
    assert torch.equal(unchunk(chunks, lay), x)  # slot_pos_of_tok inverts the layout


def test_chunk_layout_blocks_split_steps_by_budget():
    starts, lens = _bounds([64, 64, 32])
    lay = chunk_layout(lens, starts, 16, torch.device("cpu"))  # steps of 3, 3, 2, 2 slots
    assert [(s0, s1) for s0, s1, _ in lay.blocks(1, 5)] == [(0, 6), (6, 10)]
    assert [(s0, s1) for s0, s1, _ in lay.blocks(1, 1)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    (_, _, steps), = list(lay.blocks(1, 100))
    assert steps == [(0, 3, 3), (3, 3, 2), (6, 2, 2), (8, 2, 0)]  # (offset, running, running next)


@pytest.mark.parametrize("budget,block", [(1 << 20, None), (40, None), (10, 3)])
def test_scan_layout_covers_every_token_once(budget, block):
    starts, lens = _bounds(LENS)
    lay = scan_layout(lens, starts, 4, budget, 16, block)
    order = lay.order.tolist()
    assert [lens[i] for i in order] == sorted(lens, reverse=True)
    x = torch.arange(1, sum(lens) + 1, dtype=torch.float32)[:, None]  # [tot, 1], no zero row
    seen = []
    for blk in lay.blocks:
        live = [r for r in range(len(lens)) if lens[order[r]] > blk.start]
        assert blk.first + blk.seqs <= len(live)  # only running sequences, a prefix of the order
        if block is None:  # the [l, k, width] work buffer fits the budget (one token state at least)
            assert blk.length * blk.seqs * 4 <= max(budget, 4) and blk.length <= 16
        else:
            assert blk.length <= block
        got = scan_gather(x, blk)[..., 0]  # [l, k], zero on padding
        for i in range(blk.seqs):
            seq = order[blk.first + i]
            want = [starts[seq] + o + 1 for o in range(blk.start, min(lens[seq], blk.start + blk.length))]
            assert got[: len(want), i].tolist() == want and not got[len(want):, i].any()
            seen += want
    assert sorted(seen) == list(range(1, sum(lens) + 1))


def test_prepare_by_the_shape_of_g():
    q, k = torch.randn(2, 5, 1, 4), torch.randn(2, 5, 1, 4)
    v, beta = torch.randn(2, 5, 2, 3), torch.rand(2, 5, 2)
    x = prepare(q, k, v, torch.randn(2, 5, 2), beta, scale=None, initial_state=None, cu_seqlens=None,
                needs_beta=True)
    assert x.g.shape == (10, 2) and x.lens == [5, 5] and x.starts == [0, 5] and x.scale == 0.5
    x = prepare(q, k, v, torch.randn(2, 5, 2, 4), beta, scale=None, initial_state=None, cu_seqlens=None,
                needs_beta=True, g_shape="channel")
    assert x.g.shape == (10, 2, 4) and x.acc == torch.float32 and x.out_shape == (2, 5, 2, 3)
    with pytest.raises(ValueError, match=r"^g must have shape \[2, 5, 2, 4\]"):
        prepare(q, k, v, torch.randn(2, 5, 2), beta, scale=None, initial_state=None, cu_seqlens=None,
                needs_beta=True, g_shape="channel")
    with pytest.raises(ValueError, match="^g is required"):
        prepare(q, k, v, None, beta, scale=None, initial_state=None, cu_seqlens=None, needs_beta=True,
                g_shape="channel")
    x = prepare(q, k, v.double(), None, None, scale=2, initial_state=None, cu_seqlens=None, needs_beta=False)
    assert x.acc == torch.float64 and x.dtype == torch.float32 and x.g is None and x.beta is None
