"""LFM2: gated short-conv layers with a few attention layers (q/k norms), equal to transformers.

Tiny random `Lfm2ForCausalLM` checkpoints saved by transformers; the real config of an LFM2.5-1.2B
checkpoint is planned and built on the meta device exactly as the planner says.
"""

import pytest
import torch
from transformers import Lfm2Config, Lfm2ForCausalLM

from kvstate.cache.spec import cache_spec
from tests.models.checks import (check_all, check_bundled_config_builds_as_planned, check_full_forward,
                                 check_plan_matches_model, check_saved_loads_in_transformers, save_and_load,
                                 tiny_model)

VOCAB = 101
# conv, attention (4 query / 2 KV heads of 16), conv, conv; MLP width 160 -> 2/3 -> rounded up to 16: 112
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "conv"], block_multiple_of=16)


def tiny(seed: int = 0, **extra) -> Lfm2ForCausalLM:
    return tiny_model(Lfm2ForCausalLM, Lfm2Config, seed, **{**BASE, **extra})


def test_lfm2_matches_transformers(tmp_path):
    hf = tiny()
    model, plan = save_and_load(hf, tmp_path)
    assert plan.layer_string == "CACC" and plan.layers[0].ffn.intermediate_size == 112
    check_plan_matches_model(plan, model)
    assert plan.params.total == sum(p.numel() for p in hf.parameters())
    check_all(model, hf, VOCAB)
    check_saved_loads_in_transformers(model, plan, hf, tmp_path, VOCAB)


def test_biases_untied_head_and_attention_indices(tmp_path):
    """conv_bias (in_proj, conv, out_proj), an untied LM head, `full_attn_idxs` instead of layer_types."""
    hf = tiny(1, conv_bias=True, tie_word_embeddings=False, layer_types=None, full_attn_idxs=[0, 3])
    model, plan = save_and_load(hf, tmp_path)
    assert plan.layer_string == "ACCA" and not plan.tie_word_embeddings
    assert plan.params.total == sum(p.numel() for p in hf.parameters())
    check_full_forward(model, hf, VOCAB)


# The config.json of FlameF0X/LFM2.5-1.2B-Distilled-Claude-4.6, a fine-tune of LiquidAI/LFM2.5-1.2B-Thinking,
# verbatim as `curl https://huggingface.co/FlameF0X/LFM2.5-1.2B-Distilled-Claude-4.6/resolve/main/config.json`
# printed it in a public agent log (found with the search tool; no LiquidAI/LFM2-1.2B config.json text was).
LFM2_5_1_2B = """{
    "architectures": [
        "Lfm2ForCausalLM"
    ],
    "block_auto_adjust_ff_dim": true,
    "block_dim": 2048,
    "block_ffn_dim_multiplier": 1.0,
    "block_mlp_init_scale": 1.0,
    "block_multiple_of": 256,
    "block_norm_eps": 1e-05,
    "block_out_init_scale": 1.0,
    "block_use_swiglu": true,
    "block_use_xavier_init": true,
    "bos_token_id": 1,
    "conv_L_cache": 3,
    "conv_bias": false,
    "conv_dim": 2048,
    "conv_use_xavier_init": true,
    "torch_dtype": "float16",
    "eos_token_id": 7,
    "full_attn_idxs": null,
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "layer_types": [
        "conv",
        "conv",
        "full_attention",
        "conv",
        "conv",
        "full_attention",
        "conv",
        "conv",
        "full_attention",
        "conv",
        "full_attention",
        "conv",
        "full_attention",
        "conv",
        "full_attention",
        "conv"
    ],
    "max_position_embeddings": 128000,
    "model_name": "LiquidAI/LFM2.5-1.2B-Thinking",
    "model_type": "lfm2",
    "norm_eps": 1e-05,
    "num_attention_heads": 32,
    "num_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "rope_parameters": {
        "rope_theta": 1000000.0,
        "rope_type": "default"
    },
    "tie_word_embeddings": true,
    "unsloth_version": "2026.4.4",
    "use_cache": false,
    "use_pos_enc": true,
    "vocab_size": 65536
}"""


@pytest.fixture
def real_config(tmp_path):
    (tmp_path / "config.json").write_text(LFM2_5_1_2B)
    return tmp_path


def test_real_config_is_planned_and_built_exactly(real_config):
    """16 blocks (6 attention), 1.17 B parameters; per request a conv window of 3 x 2048 per conv layer and
    2 x 8 x 64 KV values per token per attention layer, in the checkpoint's float16."""
    model, plan = check_bundled_config_builds_as_planned(real_config)
    assert plan.layer_string == "CCACCACCACACACAC" and plan.layers[0].ffn.intermediate_size == 8192
    assert plan.params.total == 1_170_340_608
    spec = cache_spec(plan)
    assert spec.kv_bytes_per_token == 6 * 2 * 8 * 64 * 2
    assert spec.state_bytes == spec.conv_state_bytes == 10 * 2048 * 3 * 2
    with torch.device("meta"):  # transformers' own model of the config has as many
        hf = Lfm2ForCausalLM(Lfm2Config.from_pretrained(real_config))
    assert sum(p.numel() for p in hf.parameters()) == plan.params.total
