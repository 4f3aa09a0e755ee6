"""`kvstate bench speculative --quick` runs end to end and prints well-formed JSON (no timing is asserted)."""

import json

import pytest

from kvstate.cli import main


def test_bench_spec_quick(capsys):
    assert main(["bench", "speculative", "--quick", "--ks", "2", "--prompt-len", "8", "--new-tokens", "4",
                 "--repeats", "1", "--json", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["method"]: r for r in out["rows"]}
    assert set(rows) == {"oracle", "ngram", "draft", "mtp"}
    assert [r["k"] for r in out["rows"] if r["method"] == "mtp"] == [1, 2, 3]  # a random head, k = 1..3
    assert rows["oracle"]["acceptance"] == 1.0 and rows["oracle"]["tokens_per_step"] == 3.0
    assert all(r["exact"] for r in out["rows"])  # every drafter left greedy decoding unchanged


def test_bench_spec_on_a_chat_model_drafts_from_a_repeat_this_prompt(capsys):
    """--model takes a shipped model's name; its copy-heavy prompt is a chat asking to repeat a passage."""
    from kvstate.bench.speculative import copy_prompt
    from kvstate.llm import LLM

    assert main(["bench", "speculative", "--model", "kvstate-phonebook-hybrid", "--methods", "ngram", "--ks", "2",
                 "--new-tokens", "6", "--repeats", "1", "--json", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"].startswith("kvstate-phonebook-hybrid") and [r["method"] for r in out["rows"]] == ["ngram"]
    assert out["rows"][0]["exact"]
    llm = LLM("kvstate-phonebook-hybrid")
    try:
        text = llm.tokenizer.decode(copy_prompt(llm, 32, 6, None), skip_special_tokens=False)
    finally:
        llm.close()
    assert text.startswith("<|im_start|>user\nRepeat this:\n") and text.endswith("<|im_start|>assistant\n")


def test_bench_spec_mtp_row_on_the_shipped_hybrid(capsys):
    """The shipped hybrid carries a trained MTP head: its mtp rows draft, accept some, and stay exact."""
    assert main(["bench", "speculative", "--model", "kvstate-phonebook-hybrid", "--methods", "mtp", "--new-tokens", "8",
                 "--repeats", "1", "--json", "--threads", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["k"] for r in rows] == [1, 2, 3] and all(r["exact"] for r in rows)
    assert rows[0]["acceptance"] > 0


@pytest.mark.parametrize("ks", ["x", "0", "2,,4"])
def test_bench_spec_bad_ks_is_one_line(capsys, ks):
    assert main(["bench", "speculative", "--quick", "--ks", ks]) == 2
    err = capsys.readouterr().err
    assert "--ks" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_bench_spec_times_drafted_and_plain_runs_in_turn(capsys, monkeypatch):
    """A row's drafted and plain decodes alternate (drafted, plain, drafted, plain): each best comes
    from the same stretch of time, so load drifting over seconds does not enter their ratio."""
    from kvstate.llm import LLM

    kinds = []
    real = LLM.generate

    def generate(self, prompts, params=None, **kw):
        if params is not None and params.max_tokens == 6:  # the timed run of each pair (1 token, then 6)
            kinds.append("plain" if self.engine.proposer is None else "spec")
        return real(self, prompts, params, **kw)

    monkeypatch.setattr(LLM, "generate", generate)
    assert main(["bench", "speculative", "--model", "kvstate-phonebook-hybrid", "--methods", "ngram", "--ks", "2",
                 "--new-tokens", "6", "--repeats", "3", "--json", "--threads", "1"]) == 0
    json.loads(capsys.readouterr().out)
    assert kinds[-6:] == ["spec", "plain"] * 3


def test_bench_spec_speed_is_fastest_full_run_minus_fastest_first_token(capsys, monkeypatch):
    """Tokens/s is (N - 1) / (fastest N-token run - fastest 1-token run) over the repeats: a 1-token
    run slowed by the machine does not make its own pair look fast. On a scripted clock (each
    decoder's 1-token runs take 3 s once and 1 s once, 6-token runs 5 s) every row is 5 / (5 - 1)
    tokens/s; pairing each 1-token run with its own 6-token run gave 5 / (5 - 3)."""
    import kvstate.bench.speculative as spec
    from kvstate.llm import LLM

    clock = [0.0]
    # 1-token runs in call order: warm-up x 2, plain random x 2, plain copy-heavy x 2, then the row's
    # drafted, plain, drafted, plain
    firsts = iter([3.0, 1.0, 3.0, 1.0, 3.0, 1.0, 3.0, 3.0, 1.0, 1.0])
    real = LLM.generate

    def generate(self, prompts, params=None, **kw):
        out = real(self, prompts, params, **kw)
        clock[0] += next(firsts) if params.max_tokens == 1 else 5.0
        return out

    monkeypatch.setattr(LLM, "generate", generate)
    monkeypatch.setattr(spec, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    assert main(["bench", "speculative", "--model", "kvstate-phonebook-hybrid", "--methods", "ngram", "--ks", "2",
                 "--new-tokens", "6", "--repeats", "2", "--json", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plain_tokens_per_s"] == {"random": 1.25, "copy-heavy": 1.25}
    row = out["rows"][0]
    assert row["tokens_per_s"] == row["plain_tokens_per_s"] == 1.25 and row["speedup"] == 1.0
