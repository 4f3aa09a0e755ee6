"""`kvstate eval perplexity`: sliding windows score every token once; the perplexity equals the one
computed from transformers' log-softmax over the same windows; KL against the same weights is 0,
against fp32 it equals the naive sum over the full distributions, and a saved base file gives the
same agreement and (over its top K plus the rest) nearly the same KL; bad input is one line, exit 2."""

import json
import math

import pytest
import torch

from kvstate.cli import main
from kvstate.eval.windows import sliding_windows
from tests.engine.test_engine import tiny_qwen3_5
from tests.models.test_tokenizer import write_tokenizer

TEXT = "the quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl")
    hf = tiny_qwen3_5(vocab=300)
    hf.save_pretrained(path)
    write_tokenizer(path)
    (path / "text.txt").write_text(TEXT)
    return path, hf


@pytest.mark.parametrize("n, context, stride", [(10, 4, 2), (10, 4, 4), (100, 16, 5), (3, 8, None), (17, 2, 1)])
def test_windows_score_every_token_once_with_context(n, context, stride):
    windows = sliding_windows(n, context, stride)
    scored = [t for w in windows for t in range(w.first, w.end)]
    assert scored == list(range(1, n))
    for w in windows:
        assert w.end - w.begin <= context and w.begin < w.first <= w.end
        assert w.begin == 0 or w.first - w.begin >= max(1, context - (stride or context // 2))


def run_json(capsys, *argv) -> dict:
    assert main(["eval", "perplexity", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def reference_ppl(hf, ids, context, stride):
    nll = []
    for w in sliding_windows(len(ids), context, stride):
        with torch.no_grad():
            lp = hf(torch.tensor([ids[w.begin:w.end]])).logits[0].double().log_softmax(-1)
        nll += [-float(lp[t - 1 - w.begin, ids[t]]) for t in range(w.first, w.end)]
    return math.exp(sum(nll) / len(nll)), len(nll)


def test_perplexity_equals_transformers_over_the_same_windows(checkpoint, capsys):
    path, hf = checkpoint
    from kvstate.models.tokenizer import Tokenizer

    ids = Tokenizer(path).encode(TEXT)
    got = run_json(capsys, "--model", str(path), "--file", str(path / "text.txt"), "--context", "24", "--stride", "7")
    want, n = reference_ppl(hf, ids, 24, 7)
    row = got["rows"][0]
    assert row["tokens"] == n == len(ids) - 1 and math.isclose(row["ppl"], want, rel_tol=1e-4)


@pytest.mark.parametrize("top_k", [64, 300])
def test_kl_against_fp32_and_a_saved_base(checkpoint, capsys, tmp_path, monkeypatch, top_k):
    """From a base file of the base's top K (of a 300-token vocabulary) plus the rest: a lower bound
    of the exact KL, equal to it when K covers the vocabulary; the agreement and PPL ratio exact."""
    from kvstate.eval import perplexity

    monkeypatch.setattr(perplexity, "BASE_TOP_K", top_k)
    path, hf = checkpoint
    common = ["--model", str(path), "--file", str(path / "text.txt"), "--context", "32"]
    same = run_json(capsys, *common, "--weight-dtype", "fp32", "--kl-base", "fp32")["rows"][0]
    assert same["kl_max"] < 1e-9 and same["top1_agree"] == 1.0 and abs(same["ln_ppl_ratio"]) < 1e-9
    rows = run_json(capsys, *common, "--weight-dtype", "bf16,int8", "--kl-base", "fp32",
                    "--save-base", str(tmp_path / "bf16.base"))["rows"]
    assert [r["weight_dtype"] for r in rows] == ["bfloat16", "int8"]
    assert all(0 < r["kl_mean"] <= r["kl_max"] and 0.5 < r["top1_agree"] <= 1 for r in rows)
    # the bf16 run saved as a base: int8 against it, from the file and loaded beside, agree
    from_file = run_json(capsys, *common, "--weight-dtype", "int8", "--kl-base", str(tmp_path / "bf16.base"))
    beside = run_json(capsys, *common, "--weight-dtype", "int8", "--kl-base", "bf16")
    a, b = from_file["rows"][0], beside["rows"][0]
    assert a["top1_agree"] == b["top1_agree"] and math.isclose(a["ln_ppl_ratio"], b["ln_ppl_ratio"], rel_tol=1e-6)
    if top_k == 300:
        assert math.isclose(a["kl_mean"], b["kl_mean"], rel_tol=1e-3) and math.isclose(a["kl_max"], b["kl_max"],
                                                                                       rel_tol=1e-3)
    else:
        assert 0.2 * b["kl_mean"] < a["kl_mean"] <= b["kl_mean"] * (1 + 1e-6)


def test_naive_kl(checkpoint, capsys):
    """The mean KL against fp32 is the naive sum over the whole vocabulary, per scored token."""
    path, hf = checkpoint
    from kvstate.models.loader import load_model
    from kvstate.models.tokenizer import Tokenizer

    ids = Tokenizer(path).encode(TEXT)[:40]
    got = run_json(capsys, "--model", str(path), "--file", str(path / "text.txt"), "--context", "40",
                   "--max-tokens", "40", "--weight-dtype", "bf16", "--kl-base", "fp32")["rows"][0]
    q = load_model(path, weight_dtype="bfloat16")[0]
    from kvstate.models.generate import forward_logits

    with torch.no_grad():
        p = hf(torch.tensor([ids])).logits[0, :-1].double().log_softmax(-1)
        lq = forward_logits(q, [ids])[0][:-1].double().log_softmax(-1)
    naive = float((p.exp() * (p - lq)).sum(-1).mean())
    assert math.isclose(got["kl_mean"], naive, rel_tol=1e-3, abs_tol=1e-7)


@pytest.mark.parametrize("argv, words", [
    (["--file", "/nonexistent.txt"], "cannot read"),
    (["--context", "1"], "at least 2"),
    (["--context", "8", "--stride", "9"], "--stride"),
    (["--kl-base", "nope"], "neither a weight dtype"),
    (["--weight-dtype", "fp64"], "weight-dtype"),
    (["--save-base", "/nonexistent/dir/base"], "folder does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(checkpoint, capsys, argv, words):
    path, _ = checkpoint
    try:
        code = main(["eval", "perplexity", "--model", str(path), "--file", str(path / "text.txt"), *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_base_file_from_other_windows_is_refused(checkpoint, capsys, tmp_path):
    path, _ = checkpoint
    common = ["eval", "perplexity", "--model", str(path), "--file", str(path / "text.txt")]
    assert main([*common, "--context", "16", "--save-base", str(tmp_path / "b"), "--json"]) == 0
    capsys.readouterr()
    assert main([*common, "--context", "32", "--kl-base", str(tmp_path / "b")]) == 2
    assert "context" in capsys.readouterr().err
