"""EngineConfig: the engine's settings written once, the CLI options generated from them (no torch)."""

from __future__ import annotations

import dataclasses

import pytest

from kvstate.cli import build_parser
from kvstate.engine.config import EngineConfig
from kvstate.engine.speculative.config import SpeculativeConfig
from kvstate.errors import KvstateError
from kvstate.terminal.engine_args import engine_config

COMMANDS = {"serve": ["serve"], "generate": ["generate", "hi"]}


def _options(argv):
    from kvstate.commands import generate, serve

    args = build_parser().parse_args(argv)
    names = (serve if argv[0] == "serve" else generate).ENGINE_ARGS
    return engine_config(args, names)


def test_every_setting_is_documented():
    for f in dataclasses.fields(EngineConfig):
        assert len(f.metadata.get("help", "")) > 10, f.name


@pytest.mark.parametrize("command", COMMANDS)
def test_flag_defaults_are_the_config_defaults(command):
    """No flag given: the CLI builds the same EngineConfig as the library's defaults."""
    assert EngineConfig(**_options(COMMANDS[command])) == EngineConfig()


@pytest.mark.parametrize("command", COMMANDS)
def test_flags_and_old_spellings(command):
    base = COMMANDS[command]
    for flag in ("--enable-prefix-caching", "--prefix-caching"):
        assert _options([*base, flag])["enable_prefix_caching"] is True
    for flag in ("--tp", "--tensor-parallel-size"):
        assert _options([*base, flag, "2"])["tensor_parallel_size"] == 2
    got = _options([*base, "--cache-memory", "1GiB", "--max-model-len", "64", "--seed", "3", "--weight-dtype", "bf16"])
    assert (got["cache_memory"], got["max_model_len"], got["seed"], got["weight_dtype"]) == ("1GiB", 64, 3, "bfloat16")


def test_serve_options():
    got = _options(["serve", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--snapshot-interval", "8",
                    "--snapshot-memory", "1MiB"])
    assert (got["max_num_seqs"], got["max_num_batched_tokens"], got["snapshot_interval"],
            got["snapshot_memory"]) == (4, 64, 8, "1MiB")
    assert _options(["serve", "--snapshot-interval", "auto"])["snapshot_interval"] == "auto"


def test_speculative_config_is_parsed_once():
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert config.speculative_config == SpeculativeConfig("ngram", 2)
    assert EngineConfig(speculative_config=config.speculative_config).speculative_config is config.speculative_config
    with pytest.raises(KvstateError, match="num_speculative_tokens must be >= 1"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 0})


def test_llm_takes_config_or_fields_not_both(tmp_path):
    from kvstate.llm import LLM

    with pytest.raises(KvstateError, match="not both"):
        LLM(tmp_path, config=EngineConfig(), max_num_seqs=2)
    with pytest.raises(TypeError, match="no_such_setting"):
        LLM(tmp_path, no_such_setting=1)


def test_the_budget_without_cache_memory_holds_every_sequence_at_full_length(monkeypatch):
    """No cache_memory: the pools hold max_num_seqs requests at max_model_len (and, with prefix
    caching, 2 snapshots per sequence), unless the fraction of free memory is smaller (no torch)."""
    from types import SimpleNamespace

    from kvstate.cache.spec import cache_spec
    from kvstate.engine import budget
    from kvstate.families import read_plan

    plan = read_plan("qwen3.5-0.8b")
    spec = cache_spec(plan, kv_dtype="float32", state_dtype="float32", conv_dtype="float32")
    model = SimpleNamespace()  # one process, no MTP head
    monkeypatch.setattr(budget, "available_memory", lambda: 1 << 50)
    got = budget.engine_budget(EngineConfig(max_num_seqs=3, max_model_len=100), model, plan)
    assert got == budget.Budget(3 * (spec.state_bytes + 100 * spec.kv_bytes_per_token), 0, 3, 100, False)
    cached = budget.engine_budget(EngineConfig(max_num_seqs=3, max_model_len=100, enable_prefix_caching=True),
                                  model, plan)
    # 2 snapshot slots per sequence, within half the budget
    assert cached.cache_bytes == got.cache_bytes + 6 * spec.state_bytes
    assert cached.num_slots == 3 + min(6, cached.cache_bytes // 2 // spec.state_bytes) < 3 + 6
    monkeypatch.setattr(budget, "available_memory", lambda: 10 * spec.state_bytes)
    small = budget.engine_budget(EngineConfig(max_num_seqs=3, max_model_len=100), model, plan)
    assert small.cache_bytes == int(budget.DEFAULT_CACHE_FRACTION * 10 * spec.state_bytes)
    with pytest.raises(KvstateError, match="more than the model's maximum"):
        budget.engine_budget(EngineConfig(max_model_len=plan.max_position_embeddings + 1), model, plan)
    with pytest.raises(KvstateError, match="needs a checkpoint with multi-token-prediction"):
        budget.engine_budget(EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 1}),
                             model, plan)


def test_every_command_help_renders():
    """Help is generated from the fields' text: a literal '%' in one (activation_dtype's "~2% off")
    made argparse's %-expansion raise on `kvstate serve --help`."""
    from kvstate.cli import build_parser

    def walk(parser, path):
        assert parser.format_help(), path
        for action in parser._actions:
            if action.__class__.__name__ == "_SubParsersAction":
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")

    walk(build_parser(), "kvstate")
