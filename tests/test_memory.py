"""Cache spec and memory arithmetic: the spec documents' figures byte for byte, transformers'
own allocated caches, GPU fits, units, and the chart."""

from __future__ import annotations

import json

import pytest

from kvstate.cache import cache_spec
from kvstate.families import read_plan
from kvstate.errors import KvstateError
from kvstate.memory import (
    GIB,
    KIB,
    MIB,
    crossover_tokens,
    fit,
    format_bytes,
    format_tokens,
    parse_contexts,
    parse_size,
    parse_tokens,
)

K8, K128, K256 = 8192, 131072, 262144

# The per-request table of spec 000 (BF16 KV, FP32 states, conv = conv_dim x kernel in BF16),
# written as shared/reference/model-configs.md derives each row:
# name -> (KV bytes/token, recurrent bytes, conv bytes, printed KV/token, printed fixed state,
#          printed GiB at 8K / 128K / 256K)
TABLE = {
    "llama-3.1-8b": (32 * 2 * 8 * 128 * 2, 0, 0, "128 KiB", "0 B", (1.00, 16.00, 32.00)),
    "qwen3.5-35b-a3b": (10 * 2 * 2 * 256 * 2, 30 * 2 * MIB, 30 * 8192 * 8, "20 KiB", "61.9 MiB", (0.22, 2.56, 5.06)),
    "qwen3.5-397b-a17b": (15 * 2 * 2 * 256 * 2, 45 * 4 * MIB, 45 * 12288 * 8, "30 KiB", "184.2 MiB",
                          (0.41, 3.93, 7.68)),
    "qwen3-next-80b-a3b": (12 * 2 * 2 * 256 * 2, 36 * 2 * MIB, 36 * 8192 * 8, "24 KiB", "74.2 MiB",
                           (0.26, 3.07, 6.07)),
    "kimi-linear-48b-a3b": (7 * 576 * 2, 20 * 2 * MIB, 20 * 12288 * 8, "7.88 KiB", "41.9 MiB", (0.10, 1.03, 2.01)),
    "jamba-v0.1": (4 * 2 * 8 * 128 * 2, 28 * 512 * KIB, 28 * 8192 * 8, "16 KiB", "15.8 MiB", (0.14, 2.02, 4.02)),
    "nemotron-nano-9b-v2": (4 * 2 * 8 * 128 * 2, 27 * 5 * MIB, 27 * 12288 * 8, "16 KiB", "137.5 MiB",
                            (0.26, 2.13, 4.13)),
    # rows of model-configs.md that the spec table does not print
    "qwen3.5-0.8b": (6 * 2 * 2 * 256 * 2, 18 * MIB, 18 * 6144 * 4 * 2, "12 KiB", "18.8 MiB", None),
    "nemotron-h-8b-base-8k": (4 * 2 * 8 * 128 * 2, 24 * 4 * MIB, 24 * 10240 * 8, "16 KiB", "97.9 MiB", None),
}


@pytest.mark.parametrize("name", TABLE)
def test_spec_table_byte_for_byte(name):
    kv, recurrent, conv, kv_text, state_text, gib = TABLE[name]
    spec = cache_spec(read_plan(name))
    assert (spec.kv_bytes_per_token, spec.recurrent_state_bytes, spec.conv_state_bytes) == (kv, recurrent, conv)
    assert spec.state_bytes == recurrent + conv
    assert (format_bytes(spec.kv_bytes_per_token), format_bytes(spec.state_bytes)) == (kv_text, state_text)
    for context in (K8, K128, K256):
        assert spec.request_bytes(context) == kv * context + recurrent + conv
    if gib:
        assert tuple(round(spec.request_bytes(c) / GIB, 2) for c in (K8, K128, K256)) == gib


def test_qwen3_5_35b_worked_example():
    """Spec 000's worked numbers: 20 KiB/token, 2.5 GiB of KV at 128K, 2 MiB state + 64 KiB conv per layer."""
    spec = cache_spec(read_plan("qwen3.5-35b-a3b"))
    assert spec.kv_bytes_per_token * K128 == int(2.5 * GIB)
    linear = [e for e in spec.entries if e.kind == "gated_deltanet"]
    assert len(linear) == 30
    assert {(e.recurrent_bytes, e.conv_bytes) for e in linear} == {(2 * MIB, 64 * KIB)}


def test_qwen3_5_0_8b_walkthrough_figures():
    """Spec 002: 2048 B/token per full layer, 64 MiB per full layer at 32K, 1.5 GiB if all 24
    layers were full, a [16, 128, 128] state of 512 KiB per linear layer in BF16."""
    from kvstate.memory_plot import hypothetical_curves

    plan = read_plan("qwen3.5-0.8b")
    spec = cache_spec(plan, state_dtype="bf16")
    full = [e for e in spec.entries if e.kind == "attention"]
    linear = [e for e in spec.entries if e.kind == "gated_deltanet"]
    assert [e.layer for e in full] == [3, 7, 11, 15, 19, 23] and len(linear) == 18
    assert {e.kv_bytes_per_token for e in full} == {2048}
    assert full[0].kv_bytes_per_token * 32768 == 64 * MIB
    curves = hypothetical_curves(plan, "bfloat16")
    assert curves["GQA on all 24 layers (hypothetical)"] * 32768 == int(1.5 * GIB)
    assert curves["MHA on all 24 layers (hypothetical)"] == 24 * 2 * 8 * 256 * 2
    assert {(e.recurrent.shape, e.recurrent_bytes) for e in linear} == {((16, 128, 128), 512 * KIB)}
    assert spec.kv_bytes_per_token == 6 * 2048 and format_bytes(512 * KIB) == "512 KiB"


def test_dtypes_and_conv_window():
    plan = read_plan("qwen3.5-0.8b")
    base = cache_spec(plan)
    assert (base.kv_dtype, base.state_dtype, base.conv_dtype) == ("bfloat16", "float32", "bfloat16")
    fp8 = cache_spec(plan, kv_dtype="fp8", state_dtype="torch.bfloat16", conv_dtype="float32")
    assert fp8.kv_bytes_per_token * 2 == base.kv_bytes_per_token
    assert fp8.recurrent_state_bytes * 2 == base.recurrent_state_bytes
    assert fp8.conv_state_bytes == 2 * base.conv_state_bytes
    trimmed = cache_spec(plan, conv_window="kernel-1")
    assert trimmed.conv_state_bytes == 18 * 6144 * 3 * 2
    lfm_like = cache_spec(plan, conv_window="kernel-1").entries[0].conv.shape
    assert lfm_like == (6144, 3)
    with pytest.raises(KvstateError, match="--kv-dtype: unknown dtype 'int3'"):
        cache_spec(plan, kv_dtype="int3")
    with pytest.raises(KvstateError, match="--conv-window"):
        cache_spec(plan, conv_window="half")


# ---- transformers' allocated caches as the reference --------------------------------------------

SMALL = dict(hidden_size=64, vocab_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
TINY = {
    "qwen3_5_text": dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=8, linear_value_head_dim=12),
    "qwen3_next": dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=8, linear_value_head_dim=12, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "kimi_linear": dict(num_hidden_layers=5, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                        num_key_value_heads=4, linear_num_heads=2, linear_head_dim=8, num_local_experts=4,
                        moe_intermediate_size=32, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2),
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, num_experts=4),
    "nemotron_h": dict(layers_block_type=["mamba", "mlp", "attention", "moe"], head_dim=16, mamba_num_heads=4,
                       mamba_head_dim=8, ssm_state_size=6, n_groups=2, n_routed_experts=4, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32),
    "mamba2": dict(num_hidden_layers=2, num_heads=4, head_dim=32, state_size=6, n_groups=2, expand=2),
    "falcon_h1": dict(num_hidden_layers=2, head_dim=16, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_state=6,
                      mamba_n_groups=2),
    "lfm2": dict(num_hidden_layers=3, full_attn_idxs=[1], conv_L_cache=3),
    "granitemoehybrid": dict(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4,
                             mamba_d_state=6, mamba_n_groups=2, num_local_experts=4, shared_intermediate_size=48),
}


def _numel(t) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n


@pytest.mark.parametrize("model_type", TINY)
def test_cache_spec_equals_what_transformers_allocates(model_type):
    """Run a tiny transformers model of each family on 5 tokens and read its cache: the KV per
    token, the recurrent state and the conv window of every layer equal our spec (fp32)."""
    transformers = pytest.importorskip("transformers")
    import torch

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **{**SMALL, **TINY[model_type]})
    spec = cache_spec(read_plan(json.loads(cfg.to_json_string())), kv_dtype="float32", conv_dtype="float32")
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    tokens = 5
    with torch.no_grad():
        cache = model(torch.tensor([[1, 2, 3, 4, 5]]), use_cache=True).past_key_values
    by_layer: dict[int, dict] = {}
    for e in spec.entries:
        got = by_layer.setdefault(e.layer, {"kv": 0, "recurrent": None, "conv": None})
        got["kv"] += e.kv.numel if e.kv else 0
        got["recurrent"] = e.recurrent.shape if e.recurrent else got["recurrent"]
        got["conv"] = e.conv.shape if e.conv else got["conv"]
    assert len(cache.layers) == len(read_plan(json.loads(cfg.to_json_string())).layers)
    for i, layer in enumerate(cache.layers):
        ours = by_layer.get(i, {"kv": 0, "recurrent": None, "conv": None})
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        kv = (_numel(keys) + _numel(values)) // tokens if keys is not None else 0
        assert kv == ours["kv"], f"layer {i}"
        recurrent = getattr(layer, "recurrent_states", {}).get(0)
        theirs = None if recurrent is None else tuple(recurrent.shape[1:])
        if theirs is not None and model_type in ("nemotron_h", "mamba2", "falcon_h1", "granitemoehybrid"):
            theirs = (theirs[0], theirs[2], theirs[1])  # transformers: [H, head_dim, d_state]; ours [H, K, V]
        assert theirs == ours["recurrent"], f"layer {i}"
        conv = getattr(layer, "conv_states", {}).get(0)
        assert (None if conv is None else tuple(conv.shape[1:])) == ours["conv"], f"layer {i}"
        for t in (recurrent, conv, keys):
            assert t is None or t.dtype == torch.float32


# ---- units and fits --------------------------------------------------------------------------------

def test_parsing_and_formatting():
    assert [parse_tokens(t) for t in ("8k", "128K", "256k", "1m", "4096", "1.5k")] == \
        [8192, 131072, 262144, 1048576, 4096, 1536]
    assert parse_contexts("32k, 1m") == (32768, 1048576)
    assert parse_size("80GiB") == parse_size("80G") == parse_size("80 gib") == 80 * GIB
    assert parse_size("80GB") == 80 * 10**9 and parse_size("1536MiB") == 1536 * MIB
    assert [format_tokens(n) for n in (8192, 131072, 1048576, 5000)] == ["8K", "128K", "1M", "5000"]
    assert [format_bytes(n) for n in (0, 1023, 8064, 64 * MIB, int(2.56 * GIB))] == \
        ["0 B", "1023 B", "7.88 KiB", "64 MiB", "2.56 GiB"]
    for bad, fn in (("32q", parse_tokens), ("0", parse_tokens), ("1.3", parse_tokens), ("", parse_contexts),
                    ("80 parsecs", parse_size), ("-1G", parse_size), ("0GB", parse_size)):
        with pytest.raises(KvstateError):
            fn(bad)


def test_fit_arithmetic(tmp_path):
    plan = read_plan("qwen3.5-0.8b")
    spec = cache_spec(plan)
    gpu = 24 * GIB
    f = fit(plan, spec, gpu, (8192, 32768))
    weights = plan.params.total * 2
    assert (f.weight_bytes, f.weight_source, f.free_bytes) == (weights, "parameters", gpu - weights)
    assert f.max_requests[8192] == (gpu - weights) // (12 * KIB * 8192 + spec.state_bytes)
    assert f.max_context == 262144 and f.limited_by_model  # 1.9M tokens would fit; the model stops at 256K
    tight = fit(plan, spec, weights + spec.state_bytes + 1000 * 12 * KIB + 5, (8192,))
    assert tight.max_context == 1000 and not tight.limited_by_model and tight.max_requests[8192] == 0
    tiny = fit(plan, spec, GIB, (8192,))
    assert tiny.free_bytes < 0 and tiny.max_requests[8192] == 0 and tiny.max_context == 0
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1000)
    (ckpt / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 24)
    on_disk = fit(plan, spec, gpu, (8192,), ckpt)
    assert (on_disk.weight_bytes, on_disk.weight_source) == (1024, "safetensors")


def test_fit_without_kv_growth():
    data = {"model_type": "mamba2", "hidden_size": 256, "vocab_size": 100, "num_hidden_layers": 2, "num_heads": 8,
            "head_dim": 64, "state_size": 16, "n_groups": 1, "conv_kernel": 4, "expand": 2}
    plan = read_plan(data)
    spec = cache_spec(plan)
    assert spec.kv_bytes_per_token == 0 and crossover_tokens(spec) is None
    f = fit(plan, spec, GIB, (8192,))
    assert f.max_context is None and f.max_requests[8192] == (GIB - f.weight_bytes) // spec.state_bytes
    assert crossover_tokens(cache_spec(read_plan("jamba-v0.1"))) == (28 * 512 * KIB + 28 * 8192 * 8) / (16 * KIB)


# ---- the chart ------------------------------------------------------------------------------------

def test_plot_png_svg_and_errors(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from kvstate.memory_plot import plot

    one = [(read_plan("qwen3.5-0.8b"), cache_spec(read_plan("qwen3.5-0.8b")))]
    png = plot(one, tmp_path / "c.png", (8192, 131072))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    many = [(p, cache_spec(p)) for p in map(read_plan, ("llama-3.1-8b", "kimi-linear-48b-a3b", "jamba-v0.1"))]
    svg = plot(many, tmp_path / "c.svg", (8192,))
    text = svg.read_text()
    assert "<svg" in text and "kimi-linear-48b-a3b" in text
    with pytest.raises(KvstateError, match="must end in .png or .svg"):
        plot(one, tmp_path / "c.pdf", (8192,))
    with pytest.raises(KvstateError, match="no such directory"):
        plot(one, tmp_path / "missing" / "c.png", (8192,))
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.figure", None)
    with pytest.raises(KvstateError, match="needs matplotlib"):
        plot(one, tmp_path / "d.png", (8192,))
