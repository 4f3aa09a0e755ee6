"""`kvstate bench engine --llama-bench`: llama-bench's JSON parsed and printed beside ours (a fake
llama-bench stands in, so no llama.cpp build is needed), and `--profile`'s decode-step breakdown."""

import json
import stat
import sys

import io

import pytest
from rich.console import Console

from kvstate.bench.engine_table import show
from kvstate.bench.llama_cpp import parse_results, run_llama_bench
from kvstate.cache.spec import ENGINE_POOL_DTYPES
from kvstate.cli import main
from kvstate.errors import KvstateError
from kvstate.kernels import _ext

# llama-bench -o json prints one object per test; these are the fields kvstate reads (and a few more)
FAKE = """#!{python}
import json, sys
args = sys.argv[1:]
open({log!r}, "w").write(json.dumps(args))
if {fail}:
    print("error: failed to load model", file=sys.stderr)
    sys.exit(1)
opt = dict(zip(args[::2], args[1::2]))
if {signal!r}:
    import os, signal
    os.kill(os.getpid(), getattr(signal, {signal!r}))
tests = [t for t in [(int(opt["-p"]), 0, 173.5), (0, int(opt["-n"]), 25.25)] if t[0] or t[1]]
depths = [int(d) for d in opt.get("-d", "0").split(",")]  # -d: each test after each depth, slower deeper
print(json.dumps([dict(model_filename=opt["-m"], model_type="qwen35 ?B BF16", model_size=1123456789,
                       model_n_params=561000000, n_threads=int(opt["-t"]), n_prompt=p, n_gen=n, n_depth=d,
                       avg_ns=1, stddev_ns=0, avg_ts=ts / (1 + d / 1000), stddev_ts=0.5, samples_ts=[ts])
                  for d in depths for p, n, ts in tests], indent=2))
"""


def fake_llama_bench(tmp_path, fail=False, signal=None):
    path = tmp_path / "llama-bench"
    path.write_text(FAKE.format(python=sys.executable, log=str(tmp_path / "args.json"), fail=fail, signal=signal))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    gguf = tmp_path / "model-bf16.gguf"
    gguf.write_bytes(b"GGUF")
    return str(path), str(gguf)


def test_parse_results_names_prefill_and_decode_tests():
    text = json.dumps([dict(n_prompt=512, n_gen=0, avg_ts=103.0, stddev_ts=1.0, model_type="qwen35 F32",
                            model_size=10, n_threads=2),
                       dict(n_prompt=0, n_gen=64, avg_ts=11.5, stddev_ts=0.1, model_type="qwen35 F32",
                            model_size=10, n_threads=2)])
    rows = parse_results(text)
    assert [(r.test, r.tokens_per_s, r.threads) for r in rows] == [("pp512", 103.0, 2), ("tg64", 11.5, 2)]


@pytest.mark.parametrize("text, message", [("not json", "no JSON"), ("[]", "no test results"),
                                           ('[{"n_prompt": 1}]', "n_gen")])
def test_parse_results_errors_are_one_line(text, message):
    with pytest.raises(KvstateError, match=message):
        parse_results(text)


def test_run_llama_bench_passes_the_options_and_reports_failures(tmp_path):
    binary, gguf = fake_llama_bench(tmp_path)
    rows = run_llama_bench(binary, gguf, threads=2, prompt=512, gen=64)
    assert json.loads((tmp_path / "args.json").read_text()) == ["-m", gguf, "-t", "2", "-p", "512", "-n", "64",
                                                                "-o", "json"]
    assert {r.test: r.tokens_per_s for r in rows} == {"pp512": 173.5, "tg64": 25.25}
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    binary, gguf = fake_llama_bench(bad_dir, fail=True)
    with pytest.raises(KvstateError, match="exited with 1: error: failed to load model"):
        run_llama_bench(binary, gguf)


def test_bench_engine_prints_llama_cpp_beside_ours_and_the_step_profile(capsys, tmp_path):
    binary, gguf = fake_llama_bench(tmp_path)
    # the profile's batch 2 is above every measured batch: the engine is sized for it too
    assert main(["bench", "engine", "--quick", "--no-reference", "--batches", "1", "--prompt-len", "6",
                 "--new-tokens", "4", "--prefill-len", "12", "--threads", "1", "--profile", "1,2",
                 "--llama-bench", binary, "--gguf", gguf, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "args.json").read_text())[2:] == ["-t", "1", "-p", "12", "-n", "64", "-o", "json"]
    assert [(r["test"], r["tokens_per_s"]) for r in out["llama_cpp"]] == [("pp12", 173.5), ("tg64", 25.25)]
    ours = {(r["phase"], r["batch"]): r["tokens_per_s"] for r in out["rows"]}
    ratios = out["vs_llama_cpp"]
    assert ratios["decode b=1 vs model-bf16.gguf tg64"] == pytest.approx(ours[("decode", 1)] / 25.25)
    assert ratios["prefill vs model-bf16.gguf pp12"] == pytest.approx(ours[("prefill", 1)] / 173.5)
    assert out["machine"]["read_bandwidth_gbps"] > 0
    assert out["machine"]["huge_page_bytes"] >= 0 and "huge_pages_off" in out["machine"]
    assert all(0 < r["bandwidth_fraction"] for r in out["rows"] if r["phase"] == "decode")
    assert set(out["step_profile"]) == {"1", "1 per-op", "2", "2 per-op"}
    for b in ("1", "2"):
        assert out["step_profile"][b]["batch"] == out["step_profile"][f"{b} per-op"]["batch"] == int(b)
        prof = out["step_profile"][b]  # compiled blocks (the quick model's blocks are all served), when built
        assert (prof["parts"]["compiled blocks"] > 0) == (_ext.load() is not None)
        assert all(v >= 0 for v in prof["parts"].values()), prof
        assert sum(prof["parts"].values()) == pytest.approx(prof["step_s"])
        prof = out["step_profile"][f"{b} per-op"]
        assert prof["parts"]["compiled blocks"] == 0
        # every timed part ran (the conv step inside the fused GDN decode kernel, when it is built, is
        # part of "recurrent"); the "other" parts are remainders, so a part counted twice shows as < 0
        assert all(prof["parts"][p] > 0 for p in ("linear", "recurrent", "attention", "norm", "sampling"))
        assert (prof["parts"]["conv"] > 0) == (_ext.load() is None)
        assert all(v >= 0 for v in prof["parts"].values()), prof
        assert sum(prof["parts"].values()) == pytest.approx(prof["step_s"])
    # the human form of the same result: llama.cpp's rows in our table, the ratios, the breakdown
    console = Console(file=io.StringIO(), width=200)
    show(console, out)
    text = console.file.getvalue()
    assert "llama.cpp model-bf16.gguf" in text and "25.2" in text and "173.5" in text
    assert "llama-bench -t 1 -p 12 -n 64" in text and "decode b=1 vs model-bf16.gguf tg64" in text
    assert "decode step breakdown" in text and "weights streamed" in text


def test_bench_engine_alternates_rounds_of_both_sides(capsys, tmp_path):
    binary, gguf = fake_llama_bench(tmp_path)
    assert main(["bench", "engine", "--quick", "--no-reference", "--batches", "1", "--prompt-len", "6",
                 "--new-tokens", "4", "--prefill-len", "12", "--threads", "1", "--llama-bench", binary,
                 "--gguf", gguf, "--rounds", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "args.json").read_text())[2:] == ["-t", "1", "-p", "0", "-n", "64", "-o", "json"]
    rounds = out["vs_llama_cpp_rounds"]["decode b=1 vs model-bf16.gguf tg64"]
    assert rounds["theirs"] == [25.25] * 3 and len(rounds["ours"]) == 3
    assert rounds["ratios"] == pytest.approx([o / 25.25 for o in rounds["ours"]])
    assert rounds["median"] == pytest.approx(sorted(rounds["ratios"])[1])
    console = Console(file=io.StringIO(), width=200)
    show(console, out)
    assert "3 alternating rounds: median" in console.file.getvalue()


def test_bench_engine_llama_arguments_are_checked_first(capsys, tmp_path):
    assert main(["bench", "engine", "--quick", "--gguf", str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err
    assert "--llama-bench and --gguf go together" in err and err.count("\n") == 1
    binary, _ = fake_llama_bench(tmp_path)
    assert main(["bench", "engine", "--quick", "--llama-bench", binary, "--gguf", str(tmp_path / "missing")]) == 2
    assert "--gguf" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # a count >= 1 (argparse's one line) ...
        main(["bench", "engine", "--quick", "--rounds", "0"])
    assert exit_.value.code == 2
    # ... above 1 only with two batch sizes to alternate (or llama.cpp)
    assert main(["bench", "engine", "--quick", "--batches", "2,2", "--rounds", "3"]) == 2
    err = capsys.readouterr().err
    assert "--rounds 3: alternates two --batches" in err and err.count("\n") == 2


def test_bench_engine_alternates_rounds_of_two_batch_sizes(capsys):
    assert main(["bench", "engine", "--quick", "--no-reference", "--batches", "2,1", "--prompt-len", "6",
                 "--new-tokens", "4", "--prefill-len", "12", "--threads", "1", "--rounds", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sr = out["decode_step_rounds"]
    assert sr["batches"] == [1, 2] and all(len(sr["ms"][b]) == 3 for b in ("1", "2"))
    assert sr["ratios"] == pytest.approx([h / lo for lo, h in zip(sr["ms"]["1"], sr["ms"]["2"])])
    assert sr["median"] == pytest.approx(sorted(sr["ratios"])[1])
    console = Console(file=io.StringIO(), width=200)
    show(console, out)
    assert "decode step, batch 2 / batch 1, 3 alternating rounds: median" in console.file.getvalue()


def test_rounds_alternate_the_two_batch_sizes():
    from kvstate.bench.timing import alternate_steps

    calls = []

    def step_s(b):
        calls.append(b)
        return {1: 0.010, 8: 0.013}[b] * (1 + 0.1 * ((len(calls) - 1) // 2))  # slower each round

    sr = alternate_steps(step_s, 1, 8, 3)
    assert calls == [1, 8, 1, 8, 1, 8]
    assert sr["ratios"] == pytest.approx([1.3] * 3) and sr["median"] == pytest.approx(1.3)
    assert sr["ms"]["1"] == pytest.approx([10.0, 11.0, 12.0])


def test_a_profiled_step_that_is_not_one_token_of_each_sequence_is_refused():
    # an engine with too few sequence slots, or a token budget that chunks the prompts, runs
    # another batch than the one asked for: the profile says so instead of labelling it wrongly
    from kvstate.bench.step_profile import _check_decode
    from kvstate.engine.scheduler_output import SchedulerOutput

    step = SchedulerOutput(block_size=16)
    step.num_tokens = [1, 1]
    _check_decode(step, 2)
    for tokens in ([1], [1, 5], [1, 1, 1]):
        step.num_tokens = tokens
        with pytest.raises(KvstateError, match="max_num_seqs or max_num_batched_tokens"):
            _check_decode(step, 2)


def test_profiling_regions_count_only_while_a_collector_is_active():
    from collections import defaultdict

    from kvstate import profiling

    @profiling.timed("part")
    def step(x):
        return x + 1

    totals = defaultdict(float)
    assert step(1) == 2 and not totals  # no collector: a plain call
    with profiling.collect(totals):
        assert step(2) == 3
        with pytest.raises(RuntimeError, match="already collecting"), profiling.collect(defaultdict(float)):
            pass
    seen = totals["part"]
    assert seen > 0 and step(3) == 4 and totals["part"] == seen  # the collector is gone after the block


def test_bench_engine_reports_unmeasurable_decode_rows(capsys, monkeypatch):
    # a clock that stands still: N tokens take as long as 1 (kvstate: the later steps take no time),
    # as a busy machine can make the two calls of transformers' measure; such a row must say "not
    # measured", not a speed from a clamped difference
    import types

    from kvstate.bench import engine

    monkeypatch.setattr(engine, "time", types.SimpleNamespace(perf_counter=lambda: 1.0))
    code = main(["bench", "engine", "--quick", "--no-reference", "--batches", "1,2", "--prompt-len", "4",
                 "--new-tokens", "3", "--prefill-len", "8", "--threads", "1", "--json"])
    assert code == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    decode = [r for r in out["rows"] if r["phase"] == "decode"]
    assert len(decode) == 2 and all(r["tokens_per_s"] is None and r["bandwidth_fraction"] is None for r in decode)
    assert out["decode_scaling"] is None and "not measured" in captured.err
    console = Console(file=io.StringIO(), width=200)
    show(console, out)  # prints "-" for them
    assert "decode" in console.file.getvalue()


def test_a_llama_bench_killed_by_a_signal_says_which(tmp_path):
    """A llama.cpp build that runs an instruction the machine lacks dies of SIGILL and prints nothing:
    the error names the signal and the command, not 'exited with -4: (no message)'."""
    binary, gguf = fake_llama_bench(tmp_path, signal="SIGILL")
    with pytest.raises(KvstateError, match=r"killed by SIGILL \(an instruction this CPU.*-p 512 -n 64"):
        run_llama_bench(binary, gguf)


def test_llama_prompt_0_runs_llama_cpp_decode_only(capsys, tmp_path):
    binary, gguf = fake_llama_bench(tmp_path)
    argv = ["bench", "engine", "--quick", "--no-reference", "--batches", "1", "--prompt-len", "6", "--new-tokens", "4",
            "--prefill-len", "12", "--threads", "1", "--llama-bench", binary, "--gguf", gguf, "--json"]
    assert main(argv + ["--llama-prompt", "0"]) == 0
    assert json.loads((tmp_path / "args.json").read_text())[2:] == ["-t", "1", "-p", "0", "-n", "64", "-o", "json"]
    out = json.loads(capsys.readouterr().out)
    assert [r["test"] for r in out["llama_cpp"]] == ["tg64"] and list(out["vs_llama_cpp"]) == [
        "decode b=1 vs model-bf16.gguf tg64"]
    with pytest.raises(SystemExit):
        main(argv + ["--llama-prompt", "-1"])
    assert "argument --llama-prompt: must be at least 0, got -1" in capsys.readouterr().err


def test_bench_engine_depth_rows_beside_llama_bench_at_the_same_depths(capsys, tmp_path):
    binary, gguf = fake_llama_bench(tmp_path)
    assert main(["bench", "engine", "--quick", "--no-reference", "--batches", "1", "--prompt-len", "6",
                 "--new-tokens", "3", "--prefill-len", "8", "--threads", "1", "--depth", "16,8",
                 "--llama-bench", binary, "--gguf", gguf, "--llama-gen", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "args.json").read_text())[2:] == ["-t", "1", "-p", "8", "-n", "5", "-o", "json",
                                                                    "-d", "8,16", "-r", "1"]
    assert [r["depth"] for r in out["depth"]] == [8, 16]
    for r in out["depth"]:
        assert r["prefill_tokens"] == 8 and r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
        assert r["prompt_tokens_per_s"] > 0
    assert {(r["test"], r["depth"]) for r in out["llama_cpp_depth"]} == {
        ("pp8 @ d8", 8), ("tg5 @ d8", 8), ("pp8 @ d16", 16), ("tg5 @ d16", 16)}
    ours = {r["depth"]: r for r in out["depth"]}
    ratios = out["vs_llama_cpp_depth"]
    assert ratios["decode b=1 @ d16 vs model-bf16.gguf tg5 @ d16"] == pytest.approx(
        ours[16]["decode_tokens_per_s"] / (25.25 / 1.016))
    assert ratios["prefill @ d8 vs model-bf16.gguf pp8 @ d8"] == pytest.approx(
        ours[8]["prefill_tokens_per_s"] / (173.5 / 1.008))
    assert out["cache_dtypes"] == ENGINE_POOL_DTYPES  # what `kvstate memory` says the engine allocates
    console = Console(file=io.StringIO(), width=200)
    show(console, out)
    text = console.file.getvalue()
    assert "at depth (batch 1)" in text and "prefill @ d16 vs model-bf16.gguf pp8 @ d16" in text
    assert "KV pools float32" in text


def test_bench_engine_depth_rounds_alternate_with_llama_bench(capsys, tmp_path):
    """--rounds 2 with --depth: both sides measured twice, in turn; each depth ratio per round and its
    median, in the JSON and on one line each for humans."""
    binary, gguf = fake_llama_bench(tmp_path)
    argv = ["bench", "engine", "--quick", "--no-reference", "--batches", "1", "--prompt-len", "6", "--new-tokens",
            "3", "--prefill-len", "8", "--threads", "1", "--depth", "8", "--llama-bench", binary, "--gguf", gguf,
            "--llama-gen", "5", "--llama-prompt", "0", "--rounds", "2"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    labels = ["decode b=1 @ d8 vs model-bf16.gguf tg5 @ d8", "prefill @ d8 vs model-bf16.gguf pp8 @ d8"]
    assert sorted(out["depth_rounds"]) == labels
    for label in labels:
        each = out["depth_rounds"][label]
        assert len(each["ratios"]) == 2 and each["ratios"][0] == out["vs_llama_cpp_depth"][label]
        assert each["median"] == pytest.approx(sum(each["ratios"]) / 2) and all(r > 0 for r in each["ratios"])
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "decode b=1 @ d8 vs model-bf16.gguf tg5 @ d8, 2 alternating rounds: median" in text


@pytest.mark.parametrize("depth, message", [("12", "--depth 12: a multiple of --prefill-len (8)"),
                                            ("0", "--depth: each at least 1"), ("x", "--depth: expected")])
def test_bench_engine_bad_depths_are_one_line(capsys, depth, message):
    assert main(["bench", "engine", "--quick", "--no-reference", "--prefill-len", "8", "--depth", depth]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_block_weights_count_as_linear_and_an_empty_rate_is_not_printed():
    """GGML block projections (one or several types) are the profile's "linear" part like the float
    kernels; a profile with no linear time shows "-", not bytes over zero seconds."""
    from collections import defaultdict

    import numpy as np
    import torch
    from rich.console import Console

    from kvstate import profiling
    from kvstate.bench.step_profile import PARTS, profile_table
    from kvstate.kernels.blocks import block_linear, block_parts_linear

    raw = torch.from_numpy(np.zeros((4, 34), dtype=np.uint8))  # Q8_0 blocks of zeros: [4, 32] weights
    totals = defaultdict(float)
    with profiling.collect(totals):
        block_linear(torch.randn(1, 32), raw, None, "Q8_0")
        seen = totals["linear"]
        block_parts_linear(torch.randn(1, 32), [raw, raw], ("Q8_0", "Q8_0"))
    assert 0 < seen < totals["linear"]
    parts = dict.fromkeys(PARTS, 0.0)
    console = Console(record=True, width=200)
    console.print(profile_table({"1 per-op": {"step_s": 0.01, "parts": parts}}, weight_bytes=10**9))
    assert "GB/s" not in console.export_text()
    parts["linear"] = 0.005
    console.print(profile_table({"1 per-op": {"step_s": 0.01, "parts": parts}}, weight_bytes=10**9))
    assert "200.0 GB/s" in console.export_text()
