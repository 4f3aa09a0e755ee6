"""Tiny checkpoints of every family, saved by transformers, with head counts that divide by 2 and 4.

Each is transformers' own model with its weights redrawn at unit scale (`redraw_weights`), so a
wrong shard (a misplaced head, a bias added twice, a missed all-reduce) moves the greedy tokens.
The vocabulary (101) does not divide by 2 or 4: the last rank's vocabulary rows are fewer.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from tests.models.checks import redraw_weights

VOCAB = 101
FAMILIES = ("qwen3_5", "qwen3_5_moe", "kimi_linear", "nemotron_h", "mamba2", "jamba", "dense", "lfm2", "falcon_h1")
# (query heads, KV heads) 4/2 everywhere but Jamba's 4/1: at TP 2 and 4 its KV head is replicated
_QWEN = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
             linear_value_head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                    "full_attention"])


def _model(family: str, vocab: int = VOCAB):
    import transformers as tf

    if family == "qwen3_5":
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(intermediate_size=96, **_QWEN))
    if family == "qwen3_5_moe":
        return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            **_QWEN))
    if family == "kimi_linear":
        return tf.KimiLinearForCausalLM(tf.KimiLinearConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
            linear_num_heads=4, linear_head_dim=16, first_k_dense_replace=1, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]))
    if family == "nemotron_h":  # Mamba-2 in 2 groups: at TP 4 a norm group spans two ranks
        return tf.NemotronHForCausalLM(tf.NemotronHConfig(
            vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16,
            intermediate_size=96, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            hybrid_override_pattern="M*-EM*E"))
    if family == "mamba2":
        return tf.Mamba2ForCausalLM(tf.Mamba2Config(vocab_size=VOCAB, hidden_size=64, expand=2, num_heads=4,
                                                    head_dim=32, n_groups=2, state_size=16, conv_kernel=3,
                                                    num_hidden_layers=3, chunk_size=16))
    if family == "jamba":
        return tf.JambaForCausalLM(tf.JambaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=1, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_expand=2, mamba_d_state=8,
            mamba_d_conv=4, mamba_proj_bias=True))
    if family == "dense":
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                  attention_bias=True, mlp_bias=True))
    if family == "lfm2":  # short-conv channels (64) split; 4/2 attention heads
        return tf.Lfm2ForCausalLM(tf.Lfm2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=144, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"], block_multiple_of=16,
            conv_bias=True))
    if family == "falcon_h1":  # both mixers of each block split; at TP 4 a Mamba-2 norm group spans two ranks
        return tf.FalconH1ForCausalLM(tf.FalconH1Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8,
            mamba_n_groups=2, mamba_d_conv=4, mamba_rms_norm=True, attention_bias=True, projectors_bias=True,
            attention_in_multiplier=0.75, attention_out_multiplier=1.25, key_multiplier=0.5, ssm_in_multiplier=0.625,
            ssm_out_multiplier=1.375, mlp_multipliers=[0.875, 1.125], ssm_multipliers=[0.5, 0.75, 1.0, 1.25, 1.5],
            embedding_multiplier=2.0, lm_head_multiplier=0.5))
    raise ValueError(family)


def save_tiny(family: str, path, seed: int = 0, **kwargs):
    """Save `family`'s tiny checkpoint into `path` (returns it); kwargs: vocab (dense only)."""
    torch.manual_seed(seed)
    hf = _model(family, **kwargs).eval()
    redraw_weights(hf, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if family == "kimi_linear":  # decay rates exp(A_log) in [0.05, 1], as tests/models/test_kimi_linear.py
            for a_log in (p for name, p in hf.named_parameters() if name.endswith("A_log")):
                a_log.copy_(torch.empty(a_log.shape).uniform_(0.05, 1.0, generator=g).log())
    hf.save_pretrained(path)
    return path
