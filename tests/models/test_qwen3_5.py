"""Qwen3.5 (text, vision-language text part, MoE): Gated DeltaNet + gated attention, equal to transformers."""

import torch
from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
                          Qwen3_5MoeTextConfig, Qwen3_5TextConfig)

from tests.models.checks import check_all, redraw_weights, save_and_load

VOCAB = 101
# awkward on purpose: grouped value heads (2 key / 4 value), head dims 32 and 48, two full-attention layers
TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
            head_dim=48, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=32, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                   "linear_attention", "full_attention"])


def tiny_moe(seed: int) -> Qwen3_5MoeForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3_5MoeTextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=48, **TEXT)
    return Qwen3_5MoeForCausalLM(cfg).eval()


def test_qwen3_5_text(tmp_path):
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=96, **TEXT)).eval()
    redraw_weights(hf, 0)
    model, plan = save_and_load(hf, tmp_path)
    assert plan.layer_string == "GAGGA"
    check_all(model, hf, VOCAB)


def test_qwen3_5_moe_text(tmp_path):
    hf = tiny_moe(1)
    redraw_weights(hf, 1)
    model, plan = save_and_load(hf, tmp_path)
    check_all(model, hf, VOCAB)


def test_qwen3_5_vision_language_checkpoint_runs_its_text_model(tmp_path):
    """The multimodal checkpoint nests the text model; kvstate runs the text part and skips the vision tower."""
    torch.manual_seed(2)
    cfg = Qwen3_5Config(text_config=dict(intermediate_size=96, **TEXT),
                        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                           out_hidden_size=64, patch_size=2, temporal_patch_size=1,
                                           spatial_merge_size=1))
    hf = Qwen3_5ForConditionalGeneration(cfg).eval()
    redraw_weights(hf, 2)
    model, plan = save_and_load(hf, tmp_path)
    assert plan.model_type in ("qwen3_5", "qwen3_5_text")
    check_all(model, hf, VOCAB)


def test_saved_checkpoint_loads_in_transformers(tmp_path):
    from tests.models.checks import check_saved_loads_in_transformers

    hf = tiny_moe(3)
    model, plan = save_and_load(hf, tmp_path / "orig")
    check_saved_loads_in_transformers(model, plan, hf, tmp_path, VOCAB)
