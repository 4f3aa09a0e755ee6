"""Qwen3-Next: Gated DeltaNet (fused, per-key-head interleaved in_proj_qkvz / in_proj_ba) + gated
attention + MoE with a sigmoid-gated shared expert, equal to transformers.

Weights are redrawn at unit scale (`redraw_weights`) so that a wrong detail moves the logits.
"""

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from kvstate.config.plan import GatedDeltaNetSpec
from kvstate.families._weights import Target
from kvstate.families.qwen3_next import fused_gdn_targets
from tests.models.checks import (check_all, check_bundled_config_builds_as_planned, check_load_fails,
                                 check_saved_loads_in_transformers, redraw_weights, save_and_load)

VOCAB = 101
# awkward on purpose: 2 key heads / 6 value heads (3 per key head, so the interleave matters),
# key head dim 32, value head dim 48, attention head dim 48 with 4 query / 2 KV heads, rotary on a
# quarter of it, three full-attention layers, 4 experts (top 2) with a dense layer among them
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=48, linear_num_key_heads=2, linear_num_value_heads=6,
            linear_key_head_dim=32, linear_value_head_dim=48, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention",
                         "linear_attention", "full_attention"])
CASES = {
    "moe-mlp-only-layer": dict(mlp_only_layers=[2]),
    "sparse-step2-no-renorm": dict(decoder_sparse_step=2, norm_topk_prob=False, linear_conv_kernel_dim=3),
}
FFNS = {"moe-mlp-only-layer": ["moe", "moe", "mlp", "moe", "moe", "moe"],
        "sparse-step2-no-renorm": ["mlp", "moe"] * 3}


def tiny(case: str, seed: int = 0) -> Qwen3NextForCausalLM:
    torch.manual_seed(seed)
    hf = Qwen3NextForCausalLM(Qwen3NextConfig(**BASE, **CASES[case])).eval()
    redraw_weights(hf, seed)
    return hf


@pytest.mark.parametrize("case", list(CASES))
def test_qwen3_next_matches_transformers_and_saves_back(tmp_path, case):
    hf = tiny(case)
    model, plan = save_and_load(hf, tmp_path)
    assert plan.layer_string == "GAGAGA"
    assert [layer.ffn.kind for layer in plan.layers] == FFNS[case]
    check_all(model, hf, VOCAB)
    check_saved_loads_in_transformers(model, plan, hf, tmp_path, VOCAB)


def test_fused_projection_rows_match_transformers_split():
    """The row selection reproduces fix_query_key_value_ordering on a projection of distinct rows."""
    spec = GatedDeltaNetSpec(num_k_heads=2, num_v_heads=6, head_k_dim=3, head_v_dim=2, conv_kernel=4)
    cfg = Qwen3NextConfig(hidden_size=8, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=3,
                          linear_value_head_dim=2, num_hidden_layers=1, layer_types=["linear_attention"])
    ref = Qwen3NextForCausalLM(cfg).model.layers[0].linear_attn
    qkvz = torch.arange(2 * 2 * 3 + 2 * 6 * 2, dtype=torch.float32)[None, None]  # row ids as values [1, 1, 36]
    ba = torch.arange(2 * 6, dtype=torch.float32)[None, None]
    q, k, v, z, b, a = ref.fix_query_key_value_ordering(qkvz, ba)

    def pick(t: Target, src):
        return src[0, 0, list(t.rows)]

    qkv_t, z_t = fused_gdn_targets(0, "qkvz", spec)
    b_t, a_t = fused_gdn_targets(0, "ba", spec)
    assert qkv_t.name == "layers.0.mixer.in_proj_qkv.weight" and z_t.name == "layers.0.mixer.in_proj_z.weight"
    assert torch.equal(pick(qkv_t, qkvz), torch.cat([q.flatten(), k.flatten(), v.flatten()]))
    assert torch.equal(pick(z_t, qkvz), z.flatten())
    assert torch.equal(pick(b_t, ba), b.flatten()) and torch.equal(pick(a_t, ba), a.flatten())


def test_qwen3_next_80b_builds_to_the_planned_size_and_cache():
    """The real Qwen3-Next-80B-A3B config, built on the meta device: as many parameters as the
    planner estimates (79.7B) and exactly the per-slot state / conv and per-token KV shapes of its cache spec."""
    _, plan = check_bundled_config_builds_as_planned("qwen3-next-80b-a3b")
    assert plan.layer_string == "GGGA" * 12


def test_qwen3_next_missing_tensor_is_named(tmp_path):
    tiny("moe-mlp-only-layer").save_pretrained(tmp_path)
    check_load_fails(tmp_path, lambda t: t.pop("model.layers.4.linear_attn.in_proj_ba.weight"),
                     r"layers\.4\.mixer\.in_proj_[ab]\.weight")


def test_qwen3_next_wrong_shape_is_named(tmp_path):
    tiny("moe-mlp-only-layer").save_pretrained(tmp_path)
    key = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    check_load_fails(tmp_path, lambda t: t.__setitem__(key, t[key][:, :-1].contiguous()), r"in_proj_qkvz.*shape")


def test_qwen3_next_linear_tensor_in_an_attention_layer_is_named(tmp_path):
    tiny("moe-mlp-only-layer").save_pretrained(tmp_path)
    check_load_fails(tmp_path, lambda t: t.__setitem__("model.layers.1.linear_attn.in_proj_ba.weight",
                                                       t["model.layers.0.linear_attn.in_proj_ba.weight"].clone()),
                     r"layers\.1\.linear_attn\.in_proj_ba")
