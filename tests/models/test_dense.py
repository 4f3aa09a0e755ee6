"""Dense baselines (no state): llama with llama3 rope scaling, qwen3 with q/k norm and head_dim 48."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tests.models.checks import check_all, redraw_weights, save_and_load

VOCAB = 97
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("cfg_cls, model_cls, extra", [
    (LlamaConfig, LlamaForCausalLM, dict(rope_scaling=LLAMA3)),
    (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=48)),
], ids=["llama", "qwen3"])
def test_dense_matches_transformers(tmp_path, cfg_cls, model_cls, extra):
    torch.manual_seed(0)
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, **extra)
    hf = model_cls(cfg).eval()
    redraw_weights(hf, 0)
    model, plan = save_and_load(hf, tmp_path)
    assert plan.layer_string == "AAA"
    check_all(model, hf, VOCAB)


def _tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    hf = LlamaForCausalLM(cfg).eval()
    redraw_weights(hf, seed)
    return hf


def test_mistral_matches_transformers(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=None)
    hf = MistralForCausalLM(cfg).eval()
    redraw_weights(hf, 0)
    model, _ = save_and_load(hf, tmp_path)
    check_all(model, hf, VOCAB)


def test_sharded_checkpoint_loads(tmp_path):
    """A checkpoint split over several safetensors files with an index loads to the same logits."""
    from kvstate.models.loader import load_model
    from tests.models.checks import check_full_forward

    hf = _tiny_llama()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    model, _ = load_model(tmp_path)
    check_full_forward(model, hf, VOCAB)


def test_bf16_checkpoint_is_upcast_to_fp32(tmp_path):
    from kvstate.models.loader import load_model

    hf = _tiny_llama(1)
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, weight_dtype="fp32")  # the default keeps bf16 (tests/models/test_weight_dtype.py)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    ours = model.layers[1].ffn.down_proj.weight
    assert torch.equal(ours, hf.model.layers[1].mlp.down_proj.weight.float())  # bf16 values, exactly upcast
