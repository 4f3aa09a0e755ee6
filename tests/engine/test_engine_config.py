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
