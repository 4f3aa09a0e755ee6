"""Kimi Linear as llama.cpp's converter writes it (conversion/kimi_linear.py over TextModel), for
tests/gguf/writer.py. The converter reads the original checkpoints' names and config (dense FFNs under
`mlp`, `linear_attn_config`, `n_group`); transformers' save_pretrained names dense FFNs `block_sparse_moe`
and says `num_expert_group`, so those are read as the original spells them. Checked once by hand: the
converter's own file of such a checkpoint has these keys, names, shapes and bytes."""

from __future__ import annotations

import torch
from gguf import MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, GGUFWriter


def kimi_keys(w: GGUFWriter, c: dict) -> None:
    full = [t == "full_attention" for t in c["layer_types"]]
    w.add_context_length(c.get("max_position_embeddings") or c["model_max_length"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count_kv([1 if f else 0 for f in full])  # MLA as MQA: its latent is one KV head
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_token"])
    w.add_expert_group_used_count(c["topk_group"])  # the group count is read as `n_group`, which it is not
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    w.add_vocab_size(c["vocab_size"])
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_kda_head_dim(c["linear_head_dim"])
    if c.get("q_lora_rank"):
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(c["kv_lora_rank"])
    w.add_rope_dimension_count(c["qk_rope_head_dim"])
    w.add_key_length(c["kv_lora_rank"] + c["qk_rope_head_dim"])
    if c.get("head_dim"):  # TextModel's, not Kimi's (its value length is value_length_mla)
        w.add_value_length(c["head_dim"])
    w.add_key_length_mla(c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
    w.add_value_length_mla(c["v_head_dim"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_count(c["num_shared_experts"])
    w.add_leading_dense_block_count(c["mlp_layer_types"].index("sparse"))
    w.add_expert_weights_scale(c["routed_scaling_factor"])


def kimi_tensors(c: dict, tensors: dict):
    """KimiLinearModel.modify_tensors: convs as [1, d, 1, k], A = -exp(A_log), the experts' w1/w2/w3 stacked,
    kv_b_proj split per head into k_b (transposed) and v_b."""
    experts: dict[tuple[str, str], list] = {}
    for name, t in tensors.items():
        bid = name.split(".")[2] if ".layers." in name else None
        if bid is not None and c["mlp_layer_types"][int(bid)] == "dense":
            name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".block_sparse_moe.experts." in name:
            e, wid = name.split(".")[5:7]
            experts.setdefault((bid, wid), [None] * c["num_experts"])[int(e)] = t
            continue
        if name.endswith("e_score_correction_bias"):  # TextModel.filter_tensors
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if name.endswith(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")):
            t = t.reshape(1, t.shape[0], 1, t.shape[-1])
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        if name.endswith("kv_b_proj.weight"):
            nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
            k_b, v_b = t.view(c["num_key_value_heads"], nope + v, t.shape[-1]).split([nope, v], dim=1)
            yield name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)
            yield name.replace("kv_b_proj", "v_b_proj"), v_b
            continue
        yield name, t
    kinds = {"w1": MODEL_TENSOR.FFN_GATE_EXP, "w2": MODEL_TENSOR.FFN_DOWN_EXP, "w3": MODEL_TENSOR.FFN_UP_EXP}
    for (bid, wid), parts in experts.items():
        yield TENSOR_NAMES[kinds[wid]].format(bid=bid) + ".weight", torch.stack(parts)
