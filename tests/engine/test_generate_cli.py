"""`kvstate generate`: streams a completion and ends with the summary line; bad input is one line, exit 2."""

import json
import subprocess
import sys

import pytest

from kvstate.cli import main
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
