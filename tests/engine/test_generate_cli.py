"""`kvstate generate`: streams a completion and ends with the summary line; bad input is one line, exit 2."""

import argparse
import io
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvstate.cli import main
from kvstate.commands.generate import configure, read_prompts, summary
from kvstate.terminal.progress import load_progress
from kvstate.errors import KvstateError
from tests.engine.test_engine import tiny_qwen3_5
from tests.models.test_tokenizer import write_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen")
    tiny_qwen3_5(vocab=300).save_pretrained(path)  # the tokenizer's 300 tokens
    write_tokenizer(path)
    return path


def test_generate_streams_and_summarizes(checkpoint, capsys):
    assert main(["generate", "--model", str(checkpoint), "the quick brown", "--max-tokens", "5", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert "5 tokens" in err and "cache in use at peak: KV" in err and "state" in err
    assert out.strip()


def test_generate_json_matches_the_api(checkpoint, capsys):
    from kvstate import LLM, SamplingParams

    assert main(["generate", "--model", str(checkpoint), "hybrid models", "--chat", "--max-tokens", "4",
                 "--ignore-eos", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    llm = LLM(checkpoint, cache_memory="16MiB")
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hybrid models"}])
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert row["token_ids"] == ref.token_ids and row["finish_reason"] == "length"
    assert row["peak_cache_bytes"]["kv"] > 0 and row["peak_cache_bytes"]["state"] > 0


def test_generate_bad_model_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvstate", "generate", "--model", str(tmp_path / "nope"), "hi"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "nope" in proc.stderr


def _cli(*argv, stdin=None):
    return subprocess.run([sys.executable, "-m", "kvstate", "generate", *argv], capture_output=True, text=True,
                          input=stdin, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))


def _one_line_error(proc, needle):
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert needle in proc.stderr, proc.stderr


@pytest.mark.parametrize("value", ["-4", "0", "many"])
def test_max_model_len_must_be_positive(checkpoint, value):
    _one_line_error(_cli("--model", str(checkpoint), "--max-model-len", value, "hi"), "--max-model-len")


def test_system_without_chat_is_refused(checkpoint, capsys):
    assert main(["generate", "--model", str(checkpoint), "--system", "be brief", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--system needs --chat" in err and err.count("\n") == 1


def test_chat_in_a_fresh_process(checkpoint):
    # no transformers in this process: the chat template must render with jinja2 alone
    proc = _cli("--model", str(checkpoint), "--chat", "--system", "be brief", "hybrid models", "--max-tokens", "2",
                "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["prompt"].startswith("<|im_start|>system\nbe brief")


def test_prompt_from_stdin(checkpoint, capsys):
    proc = _cli("--model", str(checkpoint), "-", "--max-tokens", "3", "--ignore-eos", "--json",
                stdin="the quick brown\n")
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)
    assert main(["generate", "--model", str(checkpoint), "the quick brown", "--max-tokens", "3", "--ignore-eos",
                 "--json"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert row["prompt"] == "the quick brown" and row["token_ids"] == ref["token_ids"]


def test_read_prompts():
    assert read_prompts(["a", "-", "b"], io.StringIO("from stdin\n")) == ["a", "from stdin", "b"]
    assert read_prompts(["a"], io.StringIO("unused")) == ["a"]
    with pytest.raises(KvstateError, match="empty prompt"):
        read_prompts(["-"], io.StringIO(""))
    with pytest.raises(KvstateError, match="once"):
        read_prompts(["-", "-"], io.StringIO("x"))


def test_summary_after_a_failed_request(checkpoint, capsys):
    long = "the quick brown fox jumps over the lazy dog"
    assert main(["generate", "--model", str(checkpoint), long, "--max-model-len", "8", "--max-tokens", "3"]) == 2
    err = capsys.readouterr().err
    summary_line = err.strip().splitlines()[-1]
    assert "more than the model's maximum length 8" in err
    assert summary_line.startswith("0 tokens") and "first token" not in summary_line and "tok/s" not in summary_line
    assert summary_line.endswith("(error)")
    assert main(["generate", "--model", str(checkpoint), long, "hi", "--max-model-len", "8", "--max-tokens", "3",
                 "--ignore-eos"]) == 2
    summary_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert summary_line.startswith("3 tokens") and "first token" in summary_line
    assert "1 error" in summary_line and "1 length" in summary_line


def test_summary_counts_every_finish_reason():
    def out(n, reason, ttft=None, tpot=None):
        return SimpleNamespace(token_ids=[0] * n, finish_reason=reason,
                               metrics={"time_to_first_token": ttft, "time_per_output_token": tpot})

    peak = {"kv": 1024, "state": 2048}
    line = summary([out(4, "length", 0.05, 0.01), out(2, "stop", 0.02, 0.03), out(4, "length", 0.04, 0.01)], 1.0, peak)
    assert line.startswith("10 tokens in 1.00 s: 60.0 tok/s decode, first token 20 ms;")
    assert line.endswith("(2 length, 1 stop)") and "KV 1 KiB + state 2 KiB" in line
    want = "0 tokens in 0.50 s; cache in use at peak: KV 1 KiB + state 2 KiB (error)"
    assert summary([out(0, "error")], 0.5, peak) == want


def test_every_option_has_help_and_its_default():
    parser = argparse.ArgumentParser()
    configure(parser)
    for action in parser._actions:
        if action.dest == "help" or action.help == argparse.SUPPRESS:  # help, and the hidden old spellings
            continue
        assert action.help, action.dest
        if action.default not in (None, False) and action.dest != "prompt":
            assert "default" in action.help, action.dest


def test_progress_bar_only_on_a_terminal():
    from rich.console import Console

    with load_progress(Console(file=io.StringIO(), force_terminal=False)) as progress:
        assert progress is None
    with load_progress(Console(file=io.StringIO(), force_terminal=True), enabled=False) as progress:
        assert progress is None
    screen = io.StringIO()
    with load_progress(Console(file=screen, force_terminal=True)) as progress:
        progress(50, 100)
        progress(100, 100)
    assert "loading weights" in screen.getvalue()


def test_loader_reports_progress_in_bytes(checkpoint):
    from kvstate.models.loader import load_model

    calls = []
    load_model(checkpoint, progress=lambda done, total: calls.append((done, total)))
    total = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    assert calls[-1] == (total, total) and len(calls) > 2
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_generate_takes_a_hub_id(checkpoint, tmp_path, capsys):
    from tests.hub_cache import populate_from_dir

    populate_from_dir(tmp_path / "hub", "org/tiny-qwen", checkpoint)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"))
    args = ["the quick brown", "--max-tokens", "3", "--ignore-eos", "--json"]
    proc = subprocess.run([sys.executable, "-m", "kvstate", "generate", "--model", "org/tiny-qwen", *args],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert main(["generate", "--model", str(checkpoint), *args]) == 0
    assert json.loads(proc.stdout)["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    proc = subprocess.run([sys.executable, "-m", "kvstate", "generate", "--model", "org/not-cached", "hi"],
                          capture_output=True, text=True, timeout=300, env=env)
    _one_line_error(proc, "org/not-cached: no such file or directory, and not in the Hugging Face cache")


def test_max_model_len_above_the_models_is_one_line(checkpoint):
    limit = json.loads((checkpoint / "config.json").read_text())["max_position_embeddings"]
    _one_line_error(_cli("--model", str(checkpoint), "--max-model-len", str(limit + 1), "hi"),
                    f"max_model_len {limit + 1} is more than the model's maximum {limit}")


def test_samples_and_penalties_reach_the_engine(checkpoint, capsys):
    from kvstate import LLM, SamplingParams

    argv = ["generate", "--model", str(checkpoint), "the quick brown", "--max-tokens", "4", "--ignore-eos", "--n", "2",
            "--temperature", "1", "--seed", "7", "--repetition-penalty", "1.3", "--presence-penalty", "0.5"]
    assert main([*argv, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    ref = LLM(checkpoint, cache_memory="16MiB").generate(
        "the quick brown", SamplingParams(max_tokens=4, ignore_eos=True, n=2, temperature=1, seed=7,
                                          repetition_penalty=1.3, presence_penalty=0.5))[0]
    assert [o["token_ids"] for o in row["outputs"]] == [c.token_ids for c in ref.outputs]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "[sample 0]" in out and "[sample 1]" in out
    assert err.strip().splitlines()[-1].startswith("8 tokens") and "(2 length)" in err


def test_streaming_into_a_closed_pipe_is_not_an_error(checkpoint):
    proc = subprocess.Popen([sys.executable, "-m", "kvstate", "generate", "--model", str(checkpoint), "the quick",
                             "--max-tokens", "4", "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "Broken pipe" not in err
