"""`kvstate generate --prefix-caching`: the flag reaches the engine and the summary line reports
the prompt tokens served from the cache, the hit rate and the snapshots held."""

import json

from kvstate.cli import main
from kvstate.commands.generate import summary
from tests.engine.test_generate_cli import checkpoint  # noqa: F401  (the tiny checkpoint with a tokenizer)


def test_summary_line_reports_the_prefix_cache():
    peak = {"kv": 1024, "state": 2048}
    out = type("O", (), {"token_ids": [1, 2], "finish_reason": "length", "outputs": None,
                         "metrics": {"time_to_first_token": 0.05, "time_per_output_token": 0.01}})()
    stats = {"prefix_cached_tokens": 40, "prefix_prompt_tokens": 52, "prefix_hit_rate": 40 / 52,
             "snapshots_held": 3, "snapshot_bytes": 3 * 1536 * 1024}
    line = summary([out], 1.0, peak, stats)
    assert line.endswith("; prefix cache: 40 of 52 prompt tokens cached (77%), 3 snapshots 4.50 MiB")
    assert "prefix cache" not in summary([out], 1.0, peak, {"num_running": 0})  # off: not mentioned


def test_generate_prefix_caching_flag(checkpoint, capsys):  # noqa: F811
    argv = ["generate", "--model", str(checkpoint), "the quick brown fox", "--max-tokens", "3", "--ignore-eos"]
    assert main(argv + ["--prefix-caching"]) == 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "prefix cache: 0 of " in err and "prompt tokens cached (0%), 1 snapshot" in err  # the prompt end's
    assert main(argv + ["--prefix-caching", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["num_cached_tokens"] == 0
    assert main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_cached_tokens"] is None


def test_vllm_flag_name_is_an_alias():
    import argparse

    from kvstate.commands.generate import configure

    parser = argparse.ArgumentParser()
    configure(parser)
    for flag in ("--prefix-caching", "--enable-prefix-caching"):
        assert parser.parse_args(["--model", "m", "hi", flag]).enable_prefix_caching
    assert not parser.parse_args(["--model", "m", "hi"]).enable_prefix_caching
