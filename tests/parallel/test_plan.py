"""The per-rank plan (torch-free): what divides, the rank's parameters and cache, for the bundled configs."""

import pytest

from kvstate.cache.spec import cache_spec
from kvstate.families import read_plan
from kvstate.config.fields import ConfigView
from kvstate.errors import KvstateError
from kvstate.models.build import build_model
from kvstate.models.loader import family_of
from kvstate.parallel.plan import shard_plan, tp_problems, vocab_range

BUNDLED = ["qwen3.5-0.8b", "kimi-linear-48b-a3b", "nemotron-h-8b-base-8k", "jamba-v0.1", "qwen3-next-80b-a3b",
           "llama-3.1-8b"]


def test_what_does_not_divide_is_one_line_each():
    plan = read_plan("qwen3.5-0.8b")
    problems = tp_problems(plan, 3)
    assert "attention heads = 8 does not divide by --tp 3" in problems
    assert "Gated DeltaNet value heads = 16 does not divide by --tp 3" in problems
    assert len(problems) == len(set(problems))  # 24 layers, each problem once
    assert tp_problems(plan, 2) == [] and tp_problems(plan, 8) == []  # KV heads 2 < 8: replicated
    with pytest.raises(KvstateError, match="attention heads = 8 does not divide"):
        shard_plan(plan, 3)


def test_vocab_rows_cover_the_vocabulary_once():
    for vocab, tp in ((101, 4), (32000, 2), (7, 8)):
        ranges = [vocab_range(vocab, tp, r) for r in range(tp)]
        assert ranges[0][0] == 0 and ranges[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("name", BUNDLED)
@pytest.mark.parametrize("tp", [2, 4])
def test_rank_plan_counts_the_rank_model_and_divides_the_cache(name, tp):
    """The rank plan's parameter count is the rank model's (built on meta, experts and router as loaded);
    the KV per token divides by tp unless KV heads are replicated, MLA's latent never divides."""
    from kvstate.parallel.model import _local_experts

    plan = read_plan(name)
    local = shard_plan(plan, tp, tp - 1)
    opts = family_of(plan).model_options(ConfigView(plan.config, plan.source))
    model = build_model(local, opts, device="meta")
    _local_experts(model, plan, opts, tp, tp - 1)
    assert sum(p.numel() for p in model.parameters()) == local.params.total
    full, mine = cache_spec(plan), cache_spec(local)
    assert mine.state_bytes * tp == full.state_bytes
    assert full.kv_bytes_per_token // tp <= mine.kv_bytes_per_token <= full.kv_bytes_per_token


def test_memory_tp_reports_per_device_and_one_line_per_model_that_does_not_divide(capsys):
    import json

    from kvstate.cli import main

    assert main(["memory", "qwen3.5-0.8b", "--tp", "2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    local = shard_plan(read_plan("qwen3.5-0.8b"), 2)
    assert row["tp"] == 2 and row["parameters"] == local.params.total
    assert row["weight_bytes_per_device"] == local.params.total * 2  # bf16
    assert row["kv_bytes_per_token"] == cache_spec(local).kv_bytes_per_token
    # at 16: Qwen3.5-0.8B's 8 attention heads do not divide, Jamba's all do (8 KV heads replicated in pairs)
    assert main(["memory", "qwen3.5-0.8b", "jamba-v0.1", "--tp", "16", "--json"]) == 0
    out, err = capsys.readouterr()
    assert [r["model"] for r in json.loads(out)] == ["jamba-v0.1 (rank 0/16)"]
    assert err.strip().splitlines() == [line for line in err.strip().splitlines() if "qwen3.5-0.8b" in line]
    assert len(err.strip().splitlines()) == 1 and "attention heads = 8 does not divide by --tp 16" in err
    assert main(["memory", "qwen3.5-0.8b", "--tp", "3"]) == 2


def test_default_cache_budget_is_the_rank_plans_need():
    """With no cache_memory, a TP engine sizes its budget from the rank's cache (not the whole model's)."""
    from types import SimpleNamespace

    from kvstate.engine.config import EngineConfig
    from kvstate.engine.core import EngineCore
    from kvstate.engine.runner import ModelRunner
    from tests.models.checks import build_on_meta

    plan = read_plan("qwen3.5-0.8b")
    local = shard_plan(plan, 2)
    model = build_on_meta(local)  # on meta: the pools are allocated on meta too (no memory)
    model.tp_group = SimpleNamespace(size=2)
    core = EngineCore(model, plan, config=EngineConfig(max_num_seqs=2, max_model_len=64, block_size=16),
                      runner_class=lambda m, p, **kw: ModelRunner(m, m.plan, **kw))
    spec = cache_spec(local, kv_dtype="float32", state_dtype="float32", conv_dtype="float32")
    assert core.runner.pool_bytes == {"kv": core.runner.sizes.num_blocks * 16 * spec.kv_bytes_per_token,
                                      "state": 2 * spec.state_bytes}
    assert core.runner.sizes.num_blocks * 16 * spec.kv_bytes_per_token + 2 * spec.state_bytes <= \
        2 * (spec.state_bytes + 64 * spec.kv_bytes_per_token)


def test_parallel_has_no_mixer_kind_ladder():
    """Each mixer kind says how it shards (kvstate.config.mixers): parallel/ asks no isinstance(..., *Spec)."""
    import ast
    from pathlib import Path

    import kvstate.parallel

    for path in Path(kvstate.parallel.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                assert not any(n.endswith("Spec") for n in names), f"{path.name}:{node.lineno}"


# Falcon-H1's layout, tiny: attention and Mamba-2 side by side in every block
SIDE_BY_SIDE = dict(model_type="falcon_h1", vocab_size=128, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=2,
                    mamba_d_conv=4, mamba_rms_norm=True, attention_bias=True, projectors_bias=True)


@pytest.mark.parametrize("tp", [2, 4])
def test_side_by_side_mixers_shard_each_and_cut_the_built_parameters(tp):
    """Every mixer of a block shards as its kind says: the rank model (built on meta) has the rank plan's
    parameters, the rank cache is both caches' share, and each cut names a parameter of the full model."""
    from kvstate.config.options import ModelOptions
    from kvstate.parallel.shard import model_cuts

    plan = read_plan(SIDE_BY_SIDE)
    assert plan.layer_string == "HH" and plan.layers[0].mixer_names == ("mixer.attention", "mixer.mamba2")
    assert tp_problems(plan, tp) == []
    local = shard_plan(plan, tp, tp - 1)
    model = build_model(local, ModelOptions(), device="meta")
    assert sum(p.numel() for p in model.parameters()) == local.params.total
    full_spec, mine = cache_spec(plan), cache_spec(local)
    assert mine.recurrent_state_bytes * tp == full_spec.recurrent_state_bytes  # B/C groups may be replicated
    assert mine.kv_bytes_per_token == full_spec.kv_bytes_per_token // 2  # 2 KV heads: split, or one per rank
    full = dict(build_model(plan, ModelOptions(), device="meta").named_parameters())
    cuts, zero = model_cuts(plan, tp, tp - 1)
    assert "layers.1.mixer.mamba2.in_proj.weight" in cuts and "layers.0.mixer.attention.o_proj.bias" in zero
    for name, cut in cuts.items():
        if name in full:
            assert full[name].shape[cut.dim] == cut.full, name
    assert all(n in full for n in cuts if ".mixer." in n and not n.endswith(".bias"))
