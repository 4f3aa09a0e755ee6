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
