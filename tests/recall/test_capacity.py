"""`kvstate recall capacity`: write N pairs into one head's state, read them back (linear attention,
delta rule), against the spec's worked example and the delta rule's defining property."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvstate.cli import main
from kvstate.recall.capacity import capacity_rows, random_pairs, write_then_read
from kvstate.recall.tasks import IGNORE, TokenTask, accuracy_by_rank, mqar, mqar_write_ranks

# the first spec document's 2-D example: keys [1,0], [0,1], [0.6,0.8]; values [5,1], [2,4], [0,6]
KEYS = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]]], dtype=torch.float64)
VALUES = torch.tensor([[[5.0, 1.0], [2.0, 4.0], [0.0, 6.0]]], dtype=torch.float64)


def test_linear_attention_reads_the_spec_example():
    # two orthogonal writes read back exactly; after the third every read is wrong
    torch.testing.assert_close(write_then_read(KEYS[:, :2], VALUES[:, :2]), VALUES[:, :2])
    wrong = torch.tensor([[[5.0, 4.6], [2.0, 8.8], [4.6, 9.8]]], dtype=torch.float64)
    torch.testing.assert_close(write_then_read(KEYS, VALUES), wrong)


def test_delta_rule_reads_the_spec_example():
    # beta = 1: the newest exact, the older two disturbed: [2.24, 2.32], [-1.68, 5.76], [0, 6]
    want = torch.tensor([[[2.24, 2.32], [-1.68, 5.76], [0.0, 6.0]]], dtype=torch.float64)
    torch.testing.assert_close(write_then_read(KEYS, VALUES, 1.0), want)


def test_reads_equal_the_state_the_op_leaves():
    # the read half writes nothing: each read is the final state of the N writes applied to its key
    keys, values = random_pairs(3, 20, 8, seed=1)
    for beta in (None, 0.5):
        s = torch.zeros(3, 8, 8)  # [B, V, K]
        for i in range(20):
            k, v = keys[:, i], values[:, i]
            write = v if beta is None else beta * (v - torch.einsum("bvk,bk->bv", s, k))
            s = s + torch.einsum("bv,bk->bvk", write, k)
        torch.testing.assert_close(write_then_read(keys, values, beta), torch.einsum("bvk,bnk->bnv", s, keys),
                                   atol=1e-5, rtol=1e-5)


def test_a_decay_shrinks_every_older_write_alike():
    # orthonormal keys: S = sum_i a^(N-1-i) v_i k_i^T, so key i reads a^(N-1-i) v_i exactly
    keys = torch.eye(6, dtype=torch.float64)[None, :5]  # [1, 5, 6]
    values = torch.randn(1, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    scale = torch.tensor([0.8 ** (4 - i) for i in range(5)], dtype=torch.float64)[None, :, None]
    torch.testing.assert_close(write_then_read(keys, values, decay=0.8), values * scale)
    torch.testing.assert_close(write_then_read(keys, values, decay=1.0), values)
    torch.testing.assert_close(write_then_read(keys, values, beta=1.0), values)  # the delta rule erases by overlap
    with pytest.raises(ValueError, match="linear attention only"):
        write_then_read(keys, values, beta=1.0, decay=0.9)


def test_delta_rule_keeps_the_newest_write_exact_past_capacity():
    keys, values = random_pairs(8, 40, 8, seed=2)  # 5x more pairs than key dims
    keys, values = F.normalize(keys.double(), dim=-1), values.double()  # unit to fp64 precision
    reads = write_then_read(keys, values, 1.0)
    assert (reads[:, -1] - values[:, -1]).abs().max() < 1e-12
    assert (reads[:, 0] - values[:, 0]).norm(dim=-1).mean() > 0.5  # the oldest is gone


def test_who_gives_way_past_capacity():
    rows = {(r.mixer, r.beta): r for r in capacity_rows([16], [48], [1.0], decays=[0.9], trials=64, seed=0)}
    la, delta = rows[("linear attention", None)], rows[("delta rule", 1.0)]
    gated = rows[("gated linear attention", None)]
    assert gated.decay == 0.9 and gated.newest > la.newest + 0.3 and gated.oldest < 0.1  # a gate forgets the old too
    # linear attention blurs every pair alike; the delta rule keeps the newest and loses the oldest
    assert abs(la.newest - la.oldest) < 0.1
    assert delta.newest > 0.5 > 0.1 > delta.oldest
    assert delta.newest > la.newest + 0.3 and delta.oldest < la.oldest - 0.2
    assert len(delta.by_rank) == 48


def test_below_capacity_both_read_nearly_everything():
    for r in capacity_rows([32], [4], [1.0, 0.5], trials=64, seed=0):
        assert r.accuracy > 0.97 and r.cosine > 0.85, r


def test_mqar_write_ranks_name_the_asked_pair():
    task = mqar(50, 64, 12, vocab_size=256, seed=3)
    ranks = mqar_write_ranks(task, 12)
    b, t = np.nonzero(task.targets != IGNORE)
    assert len(ranks) == len(b) and ranks.min() >= 0 and ranks.max() <= 11
    # the pair at write rank r sits at positions 2r (key), 2r + 1 (value): its value is the target
    np.testing.assert_array_equal(task.inputs[b, 2 * ranks + 1], task.targets[b, t])
    np.testing.assert_array_equal(task.inputs[b, 2 * ranks], task.inputs[b, t])


def test_accuracy_by_rank_averages_per_rank():
    hits = np.array([1, 0, 1, 1, 0], dtype=bool)
    ranks = np.array([0, 0, 2, 2, 2])
    assert accuracy_by_rank(hits, ranks, 4) == [0.5, None, pytest.approx(2 / 3, abs=1e-4), None]
    task = TokenTask(np.array([[5, 9, 6, 8, 6, 0]]), np.array([[IGNORE] * 4 + [8, IGNORE]]))
    assert mqar_write_ranks(task, 2).tolist() == [1]


def test_cli_capacity_json_and_plot(capsys, tmp_path):
    plot = tmp_path / "capacity.png"
    args = ["recall", "capacity", "--key-dim", "4,8", "--pairs", "2,16", "--beta", "1,0.5", "--trials", "8",
            "--plot", str(plot)]
    assert main(args + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * 2 * 4  # key dims x pairs x (linear attention, decay 0.9 (the default), two betas)
    assert {(r["mixer"], r["beta"], r["decay"]) for r in rows} == {
        ("linear attention", None, None), ("gated linear attention", None, 0.9), ("delta rule", 1.0, None),
        ("delta rule", 0.5, None)}
    assert set(rows[0]) == {"mixer", "beta", "decay", "key_dim", "pairs", "accuracy", "newest", "oldest", "cosine",
                            "by_rank"}
    assert plot.stat().st_size > 10_000
    assert main(args) == 0  # for humans: a table
    out = capsys.readouterr().out
    assert "delta rule, beta 0.5" in out and "gated linear attention, decay 0.9" in out and "newest 1/4" in out
    assert "{" not in out
    assert main(args + ["--decay", "", "--json"]) == 0  # no gated rows
    assert {r["mixer"] for r in json.loads(capsys.readouterr().out)} == {"linear attention", "delta rule"}


@pytest.mark.parametrize("argv, message", [
    (["--pairs", "0"], "--pairs"),
    (["--key-dim", "a"], "--key-dim"),
    (["--beta", "1.5"], "--beta"),
    (["--beta", "0"], "--beta"),
    (["--trials", "100001"], "--trials"),
    (["--decay", "1.5"], "--decay"),
    (["--plot", "/no-such-dir/capacity.png"], "no such directory"),
    (["--plot", "capacity.pdf"], "must end in .png or .svg"),
])
def test_cli_capacity_bad_input_is_one_line_exit_2(capsys, argv, message):
    assert main(["recall", "capacity", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
