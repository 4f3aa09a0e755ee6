"""Nemotron-H: Mamba-2, attention (no RoPE), relu^2 MLP and latent MoE blocks, equal to transformers.

Checkpoints are transformers' NemotronHForCausalLM (backbone.* names, per-expert tensors) with
weights redrawn at unit scale, in both config spellings: `layers_block_type` (what transformers
writes) and the older `hybrid_override_pattern` with the `mamba_*` key aliases.
"""

import json

import pytest
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from kvstate.cache.pools import allocate_pools
from kvstate.cache.spec import cache_spec
from kvstate.models.batch import Batch
from kvstate.models.generate import contiguous_caches
from kvstate.models.loader import load_model
from tests.models.checks import (check_all, check_full_forward, check_load_fails, check_plan_matches_model,
                                 check_saved_loads_in_transformers, random_ids, redraw_weights, rel_err,
                                 rewrite_checkpoint, save_and_load)

VOCAB = 101
# awkward on purpose: Mamba-2 4 heads of 32 in 2 groups; attention 4 query / 2 KV heads of 48 at two
# positions; MoE of 4 relu^2 experts (top-2) in 2 routing groups (top-1 group), scaling 2.5, latent 40
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
            mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16,
            intermediate_size=96, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=2.5)
PATTERN = "M*-EM*E"


def tiny(seed: int = 0, pattern: str = PATTERN, **extra) -> NemotronHForCausalLM:
    torch.manual_seed(seed)
    hf = NemotronHForCausalLM(NemotronHConfig(**{**BASE, "hybrid_override_pattern": pattern, **extra})).eval()
    redraw_weights(hf, seed)
    return hf


def test_nemotron_h_matches_transformers(tmp_path):
    hf = tiny(moe_latent_size=40)
    model, plan = save_and_load(hf, tmp_path)
    assert plan.layer_string == "MA--MA-"
    assert [layer.ffn.kind for layer in plan.layers] == ["none", "none", "mlp", "moe", "none", "none", "moe"]
    assert plan.layers[3].ffn.latent_size == 40
    assert plan.params.total == sum(p.numel() for p in hf.parameters())
    check_all(model, hf, VOCAB)


def test_hybrid_override_pattern_and_legacy_spellings(tmp_path):
    """The older config form (pattern string, mamba_n_groups / mamba_d_conv / mamba_dt_min /
    mamba_conv_bias) reads as the same model in kvstate and in transformers; plain MoE without the
    latent projection; Mamba projections with biases, conv without."""
    hf = tiny(1, pattern="M-E*MM*", use_bias=True, use_conv_bias=False)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg.pop("layers_block_type")
    cfg.update(hybrid_override_pattern="M-E*MM*", mamba_n_groups=cfg.pop("n_groups"),
               mamba_d_conv=cfg.pop("conv_kernel"), mamba_dt_min=cfg.pop("time_step_min"),
               mamba_conv_bias=cfg.pop("use_conv_bias"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, plan = load_model(tmp_path)
    assert plan.layer_string == "M--AMMA" and plan.mixers("mamba2")[0][1].n_groups == 2
    assert plan.params.total == sum(p.numel() for p in hf.parameters())
    legacy = NemotronHForCausalLM.from_pretrained(tmp_path).eval()
    check_full_forward(model, legacy, VOCAB)
    check_full_forward(model, hf, VOCAB)


@torch.inference_mode()
def _stepped(model, ids, prompt_len):
    """Our logits for a prefill of prompt_len tokens, then one decode step per remaining token."""
    caches = contiguous_caches(model, 1, len(ids))
    rows = [model(torch.tensor(ids[:prompt_len]), Batch.build([prompt_len], [0], [0], [[0]], len(ids), logits="all"),
                  caches)]
    for p in range(prompt_len, len(ids)):
        rows.append(model(torch.tensor([ids[p]]), Batch.build([1], [p], [0], [[0]], len(ids)), caches))
    return torch.cat(rows)


@torch.inference_mode()
def _hf_stepped(hf, ids, prompt_len):
    out = hf(torch.tensor([ids[:prompt_len]]), use_cache=True)
    rows, cache = [out.logits[0]], out.cache
    for p in range(prompt_len, len(ids)):
        out = hf(torch.tensor([[ids[p]]]), cache=cache, use_cache=True)
        rows.append(out.logits[0])
        cache = out.cache
    return torch.cat(rows).float()


def test_dt_clamp_follows_transformers_in_prefill_and_decode(tmp_path):
    """Where softplus(dt + dt_bias) falls under time_step_min, transformers clamps it in the chunked
    scan but not in the decode step; kvstate does the same on both paths."""
    hf = tiny(2)
    with torch.no_grad():
        hf.model.layers[0].mixer.dt_bias[:2] = -9.0  # softplus ~ 1e-4 < time_step_min = 1e-3
    model, _ = save_and_load(hf, tmp_path)
    ids = random_ids(VOCAB, 30, 4)
    hf_full, hf_steps = _hf_stepped(hf, ids, len(ids)), _hf_stepped(hf, ids, 12)
    assert rel_err(hf_steps, hf_full) > 1e-3  # the clamp matters here
    assert rel_err(_stepped(model, ids, len(ids)), hf_full) <= 1e-4
    assert rel_err(_stepped(model, ids, 12), hf_steps) <= 1e-4


def test_cache_shapes_agree_with_the_cache_spec(tmp_path):
    model, plan = save_and_load(tiny(), tmp_path)
    assert plan.layer_string == "MA--MA-"  # state + conv, k + v, and no cache at all
    check_plan_matches_model(plan, model)


@pytest.mark.parametrize("window", ["kernel", "kernel-1"])
def test_pools_are_allocated_from_the_cache_spec_alone(tmp_path, window):
    """Pool keys and per-entry shapes are the spec entries' (a conv window of W or W-1 columns), and the
    pools hold exactly the planner's bytes."""
    model, plan = save_and_load(tiny(), tmp_path)
    spec = cache_spec(plan, kv_dtype="float32", conv_dtype="bfloat16", conv_window=window)
    caches = allocate_pools(spec, num_blocks=3, block_size=16, num_slots=2)
    w = 4 - (window == "kernel-1")
    assert [sorted(k for k in ("k", "v", "state", "conv") if getattr(c, k) is not None) for c in caches] == [
        ["conv", "state"], ["k", "v"], [], [], ["conv", "state"], ["k", "v"], []]
    assert caches[0].conv.shape == (2, 128 + 2 * 2 * 16, w) and caches[0].conv.dtype == torch.bfloat16
    assert caches[1].k.shape == (3, 16, 2, 48) and caches[4].state.shape == (2, 4, 16, 32)
    assert sum(c.nbytes() for c in caches) == 3 * 16 * spec.kv_bytes_per_token + 2 * spec.state_bytes


def test_saved_checkpoint_loads_in_transformers(tmp_path):
    hf = tiny(3, moe_latent_size=40)
    model, plan = save_and_load(hf, tmp_path / "orig")
    check_saved_loads_in_transformers(model, plan, hf, tmp_path, VOCAB)


def test_fused_expert_checkpoint_loads(tmp_path):
    """Experts stored fused (mixer.experts.up_proj [E, I, H] / down_proj [E, H, I], transformers'
    in-memory layout) load like the per-expert tensors it writes; multi-token-prediction tensors
    (mtp.*) are skipped, as transformers skips them."""
    hf = tiny(4)
    hf.save_pretrained(tmp_path)

    def fuse(tensors):
        for layer in (3, 6):
            for which in ("up_proj", "down_proj"):
                keys = [f"backbone.layers.{layer}.mixer.experts.{e}.{which}.weight" for e in range(4)]
                tensors[f"backbone.layers.{layer}.mixer.experts.{which}"] = torch.stack([tensors.pop(k) for k in keys])
        tensors["mtp.layers.0.mixer.q_proj.weight"] = torch.zeros(8, 64)

    model, _ = load_model(rewrite_checkpoint(tmp_path, fuse))
    check_full_forward(model, hf, VOCAB)


def test_missing_expert_tensor_is_named(tmp_path):
    tiny().save_pretrained(tmp_path)
    check_load_fails(tmp_path, lambda t: t.pop("backbone.layers.3.mixer.experts.1.up_proj.weight"),
                     r"missing tensors for layers\.3\.ffn\.experts\.gate_up")


def test_wrong_shape_is_named(tmp_path):
    tiny().save_pretrained(tmp_path)
    key = "backbone.layers.1.mixer.k_proj.weight"
    check_load_fails(tmp_path, lambda t: t.__setitem__(key, torch.zeros(64, 64)),
                     r"backbone\.layers\.1\.mixer\.k_proj\.weight.*shape \(64, 64\)")
