"""Tiny recall models train: every mixer's gradient is right, a short MQAR run learns far above
chance, a resumed run equals an uninterrupted one, and the CLI gives JSON and one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvstate.cli import main
from kvstate.ops import chunk_delta_rule, chunk_linear_attention, naive_delta_rule, naive_linear_attention
from kvstate.recall import mixers, plots
from kvstate.errors import KvstateError
from kvstate.recall.data import make_sets, phonebook_task
from kvstate.recall.model import RecallModel
from kvstate.recall.tasks import IGNORE
from kvstate.recall.trainer import TrainConfig, train

TINY = dict(width=32, seq_len=16, pairs=2, vocab=32, train_examples=256, eval_examples=64, batch_size=32)


@pytest.mark.parametrize("kind", list(mixers.KINDS))
def test_gradient_matches_finite_difference(kind):
    """Directional derivative of the loss along a random direction: autograd vs central difference, in
    fp64 (the ops keep some fp32 internals, hence the 0.3% tolerance; a missing gradient path is far off)."""
    torch.manual_seed(0)
    model = RecallModel(kind + kind, 40, 16, heads=2).double()
    ids = torch.randint(0, 40, (3, 20))
    loss = lambda: model(ids).square().mean()  # noqa: E731
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss(), params)
    dirs = [torch.randn_like(p) for p in params]
    analytic = sum(float((g * d).sum()) for g, d in zip(grads, dirs))
    eps = 1e-5
    with torch.no_grad():
        for p, d in zip(params, dirs):
            p.add_(eps * d)
        up = float(loss())
        for p, d in zip(params, dirs):
            p.sub_(2 * eps * d)
        down = float(loss())
    numeric = (up - down) / (2 * eps)
    assert abs(numeric - analytic) <= 3e-3 * abs(analytic) + 1e-6, (numeric, analytic)


@pytest.mark.parametrize("op, naive, extra", [(chunk_linear_attention, naive_linear_attention, 0),
                                               (chunk_delta_rule, naive_delta_rule, 1)])
def test_op_mixer_gradients_equal_naive_op(op, naive, extra):
    """The chunk ops the linear-attention and DeltaNet mixers train through: their gradients equal
    those through the per-token naive form (the reference we did not derive by hand)."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 37, 2, 8, requires_grad=True) for _ in range(3))
    beta = [torch.rand(2, 37, 2, requires_grad=True)] * extra
    grads = []
    for fn in (op, naive):
        qn, kn = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
        o, _ = fn(qn, kn, v, *beta)
        grads.append(torch.autograd.grad((o * torch.linspace(-1, 1, 8)).sum(), [q, k, v, *beta]))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads", [1, 2])
def test_batched_attention_equals_the_layers_paged_path(heads):
    """The recall model's attention runs B equal-length sequences as one SDPA call; it must give
    the outputs and gradients of the attention layer's own paged prefill path."""
    torch.manual_seed(0)
    mixer = mixers.make_mixer("A", mixers.MixerSize(16, heads, 16 // heads))
    x = torch.randn(3, 21, 16)
    outs = []
    for batched in (True, False):
        mixer.batched_attention = batched
        xi = x.clone().requires_grad_(True)
        o = mixer(xi, mixers.Packed.of(3, 21))
        grads = torch.autograd.grad((o * torch.linspace(-1, 1, 16)).sum(), [xi, *mixer.parameters()])
        outs.append((o, *grads))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_short_mqar_run_learns():
    """Attention with its short conv learns MQAR far above chance (1 / 16 values) in 32 steps."""
    cfg = TrainConfig(layers="AA", epochs=4, lr=3e-3, **TINY)
    result = train(cfg)
    assert result["finished"] and result["steps"] == 4 * 8
    first, last = result["curve"][0][1], sum(c[1] for c in result["curve"][-4:]) / 4
    assert last < 0.75 * first
    assert result["eval_accuracy"] > 0.25


def test_resume_equals_uninterrupted(tmp_path):
    cfg = TrainConfig(layers="LA", epochs=2, **TINY)
    whole = train(cfg, checkpoint=str(tmp_path / "a.pt"))
    cut = str(tmp_path / "b.pt")
    part = train(cfg, checkpoint=cut, stop_after=5)  # interrupted mid-epoch: saved at the stop
    assert part["steps"] == 5 and not part["finished"]
    resumed = train(cfg, checkpoint=cut, resume=True)
    assert resumed["curve"] == whole["curve"] and resumed["eval_accuracy"] == whole["eval_accuracy"]
    a, b = torch.load(str(tmp_path / "a.pt"), weights_only=False), torch.load(cut, weights_only=False)
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key


def test_resume_takes_a_checkpoint_written_before_an_option_existed(tmp_path):
    cfg = TrainConfig(layers="LL", epochs=1, **TINY)
    cut = str(tmp_path / "c.pt")
    train(cfg, checkpoint=cut, stop_after=3)
    saved = torch.load(cut, weights_only=False)
    del saved["config"]["fill"]  # as written before --fill: its default is what that run used
    torch.save(saved, cut)
    assert train(cfg, checkpoint=cut, resume=True)["finished"]
    with pytest.raises(KvstateError, match="another configuration"):
        train(TrainConfig(layers="LL", epochs=1, fill="zero", **TINY), checkpoint=cut, resume=True)


def test_zero_fill_leaves_only_the_pairs_and_the_queries():
    config = TrainConfig(layers="LL", fill="zero", **{**TINY, "seq_len": 32, "pairs": 4, "vocab": 64})
    train_set, _, _ = make_sets(config)
    region = train_set.inputs[:, 8:]  # after the 4 pairs
    queried = train_set.targets[:, 8:] != IGNORE
    assert (region[~queried] == 0).all() and (region[queried] > 0).all()
    random_set, _, _ = make_sets(TrainConfig(layers="LL", **{**TINY, "seq_len": 32, "pairs": 4, "vocab": 64}))
    assert (random_set.inputs[:, 8:][random_set.targets[:, 8:] == IGNORE] != 0).mean() > 0.9
    assert TrainConfig(fill="zero", lr=1e-3).name.endswith("-lr0.001-zerofill")
    with pytest.raises(KvstateError, match="fill"):
        TrainConfig(fill="noise").check()


def test_phonebook_targets_are_the_answer_digits():
    task = phonebook_task(3, 5, queries=2, seed=4)
    for row, target in zip(task.inputs, task.targets):
        text = bytes(row[row > 0].astype(np.uint8)).decode()
        answers = [line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith("What")]
        scored = np.nonzero(target != -100)[0]
        assert "".join(chr(c) for c in target[scored]) == "".join(answers)
        assert all(chr(row[i + 1]) == chr(target[i]) for i in scored)  # predicted from the position before


def test_cli_train_json(capsys, tmp_path):
    args = ["recall", "train", "--json", "--layers", "GA", "--width", "32", "--seq-len", "16", "--pairs", "2",
            "--vocab", "32", "--train-examples", "64", "--eval-examples", "32", "--epochs", "1",
            "--batch-size", "32", "--out", str(tmp_path)]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["layers"] == "GA" and result["steps"] == 2 and result["finished"]
    assert result["state_bytes_per_layer"] == 32 * 32 * 4 and result["kv_bytes_per_layer"] == 2 * 32 * 16 * 4
    assert 0 <= result["eval_accuracy"] <= 1
    assert {p.name for p in tmp_path.iterdir()} >= {"result.json", "checkpoint.pt", "curve.png"}
    assert main(args + ["--resume"]) == 0  # finished: resumes to the same result without training
    assert json.loads(capsys.readouterr().out)["curve"] == result["curve"]
    assert main([a for a in args if a != "--json"] + ["--resume"]) == 0  # for humans: a table
    out = capsys.readouterr().out
    assert "mqar-GA-w32-p2" in out and "accuracy" in out and "newest 1/4" in out and "{" not in out
    assert len(result["eval_by_write_rank"]) == 2  # MQAR: accuracy per pair, oldest first


def test_recall_without_subcommand_prints_help(capsys):
    assert main(["recall"]) == 0
    out = capsys.readouterr().out
    assert "train" in out and "sweep" in out


def test_cli_sweep_writes_results_and_plots(capsys, tmp_path):
    args = ["recall", "sweep", "--json", "--layers", "LL,AA", "--width", "32", "--key-dim", "8,16",
            "--seq-len", "16", "--pairs", "2,4", "--vocab", "32", "--train-examples", "32", "--eval-examples",
            "16", "--epochs", "1", "--batch-size", "32", "--out", str(tmp_path)]
    assert main(args) == 0
    results = json.loads(capsys.readouterr().out)
    # LL at two key dims x two pair counts, AA (no fixed state: one key dim) x two pair counts
    assert sorted(r["name"] for r in results) == sorted(
        ["mqar-LL-w32-k8-p2", "mqar-LL-w32-k16-p2", "mqar-LL-w32-k8-p4", "mqar-LL-w32-k16-p4",
         "mqar-AA-w32-p2", "mqar-AA-w32-p4"])
    assert {r["state_bytes_per_layer"] for r in results} == {8 * 8 * 4, 16 * 16 * 4, None}
    assert {"sweep.json", "accuracy_vs_pairs.png", "accuracy_vs_state.png"} <= {p.name for p in tmp_path.iterdir()}


def test_cli_sweep_over_learning_rates_plots_the_best(capsys, tmp_path):
    args = ["recall", "sweep", "--json", "--layers", "LL", "--width", "32", "--seq-len", "16", "--pairs", "2",
            "--vocab", "32", "--train-examples", "32", "--eval-examples", "16", "--epochs", "1", "--batch-size", "32",
            "--lr", "1e-3,3e-3", "--fill", "zero", "--out", str(tmp_path)]
    assert main(args) == 0
    results = json.loads(capsys.readouterr().out)
    assert sorted(r["name"] for r in results) == ["mqar-LL-w32-p2-lr0.001-zerofill", "mqar-LL-w32-p2-zerofill"]
    assert {r["config"]["fill"] for r in results} == {"zero"} and {r["config"]["lr"] for r in results} == {1e-3, 3e-3}
    # a plot's point is the better learning rate of each model and setting
    a, b = ({"config": {**r["config"]}, "eval_accuracy": acc} for r, acc in zip(results, (0.4, 0.7)))
    other = {"config": {**a["config"], "pairs": 4}, "eval_accuracy": 0.1}
    assert plots._best_lr([a, b, other]) == [b, other]


@pytest.mark.parametrize("argv, message", [
    (["train", "--layers", "AX"], "layer pattern"),
    (["train", "--pairs", "0"], "--pairs"),
    (["train", "--pairs", "40", "--seq-len", "64"], "mqar"),
    (["train", "--resume"], "--resume needs --out"),
    (["train", "--layers", "AA,LL"], "sweep"),
    (["train", "--width", "30", "--heads", "4"], "multiple of heads"),
    (["train", "--epochs", "0"], "--epochs: must be at least 1"),
    (["train", "--lr", "fast"], "--lr"),
    (["train", "--lr", "1e-3,3e-3"], "sweep"),
    (["train", "--lr", "2"], "lr must be"),
    (["train", "--lr", "nan"], "lr must be"),
    (["train", "--weight-decay", "nan"], "weight decay >= 0 and finite"),
    (["train", "--weight-decay", "inf"], "weight decay >= 0 and finite"),
    (["train", "--weight-decay", "-0.1"], "weight decay >= 0 and finite"),
    (["train", "--task", "needle"], "invalid choice"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    parsing = message == "invalid choice" or "must be at least" in message  # argparse's errors exit
    with pytest.raises(SystemExit) if parsing else _nothing() as raised:
        rc = main(["recall", *argv])
    rc = raised.value.code if parsing else rc
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
