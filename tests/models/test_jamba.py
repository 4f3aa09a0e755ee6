"""Jamba: Mamba-1 + attention (no RoPE) + sparse MoE every other layer, equal to transformers.

The tiny checkpoints are transformers' own JambaForCausalLM with its weights redrawn at unit
scale (`redraw_weights`: its default init of std 0.02 leaves the mixers' outputs too small for a
wrong detail to move the logits by more than the tolerance).
"""

import pytest
import torch
from transformers import JambaConfig, JambaForCausalLM

from kvstate.models.loader import load_model
from tests.models.checks import (check_all, check_bundled_config_builds_as_planned, check_full_forward,
                                 check_load_fails, check_saved_loads_in_transformers, redraw_weights,
                                 rewrite_checkpoint, save_and_load)

VOCAB = 101
# awkward on purpose: GQA with one KV head, head dims 32 and 48, two attention layers, four
# experts (top-2) every other layer; dt_rank "auto" (ceil(hidden / 16) = 6) and explicit
BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=64, num_hidden_layers=6, num_key_value_heads=1,
            attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
            num_experts_per_tok=2, mamba_expand=2)
CASES = {
    "head32": dict(num_attention_heads=3, mamba_d_state=16, mamba_d_conv=4),
    "head48-projbias-noconvbias": dict(num_attention_heads=2, mamba_d_state=8, mamba_d_conv=3, mamba_dt_rank=5,
                                       mamba_proj_bias=True, mamba_conv_bias=False),
}


def tiny(case: str, seed: int = 0) -> JambaForCausalLM:
    torch.manual_seed(seed)
    hf = JambaForCausalLM(JambaConfig(**BASE, **CASES[case])).eval()
    redraw_weights(hf, seed)
    return hf


@pytest.mark.parametrize("case", list(CASES))
def test_jamba_matches_transformers_and_saves_back(tmp_path, case):
    hf = tiny(case)
    model, plan = save_and_load(hf, tmp_path)
    assert plan.layer_string == "SASSAS"
    assert [layer.ffn.kind for layer in plan.layers] == ["mlp", "moe"] * 3
    check_all(model, hf, VOCAB)
    check_saved_loads_in_transformers(model, plan, hf, tmp_path, VOCAB)


def test_jamba_v0_1_builds_to_the_planned_size_and_cache():
    """The real Jamba v0.1 config, built on the meta device: as many parameters as the planner
    estimates (51.6B) and exactly the per-slot state / conv and per-token KV shapes of its cache spec."""
    _, plan = check_bundled_config_builds_as_planned("jamba-v0.1")
    assert plan.layer_string == "SSSSASSS" * 4


def test_jamba_missing_tensor_is_named(tmp_path):
    tiny("head32").save_pretrained(tmp_path)
    check_load_fails(tmp_path, lambda t: t.pop("model.layers.2.mamba.dt_layernorm.weight"),
                     r"layers\.2\.mixer\.dt_layernorm\.weight")


def test_jamba_wrong_shape_is_named(tmp_path):
    tiny("head32").save_pretrained(tmp_path)
    key = "model.layers.3.mamba.A_log"
    check_load_fails(tmp_path, lambda t: t.__setitem__(key, t[key][:, :-1].contiguous()),
                     r"model\.layers\.3\.mamba\.A_log.*shape")


def test_jamba_fused_expert_checkpoint_loads(tmp_path):
    """Experts stored fused (feed_forward.experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I], the
    layout transformers holds in memory) load like the per-expert tensors it writes."""
    hf = tiny("head32", seed=3)
    hf.save_pretrained(tmp_path)
    state = hf.state_dict()

    def fuse(tensors):
        for key in [k for k in tensors if ".experts." in k]:
            del tensors[key]
        for key, value in state.items():
            if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[key] = value.contiguous()

    model, _ = load_model(rewrite_checkpoint(tmp_path, fuse))
    check_full_forward(model, hf, VOCAB)


@torch.inference_mode()
def test_jamba_batched_decode_in_shuffled_slots_equals_each_alone(tmp_path):
    """Three sequences prefilled together, then decoded together from state slots and KV blocks
    in another order than the batch's, give each sequence's own full-forward logits."""
    from kvstate.models.batch import Batch
    from kvstate.models.generate import contiguous_caches, forward_logits

    from tests.models.checks import random_ids, rel_err

    model, _ = save_and_load(tiny("head32", seed=4), tmp_path)
    prompts, steps = (9, 3, 14), 5
    seqs = [random_ids(VOCAB, n + steps, 20 + i) for i, n in enumerate(prompts)]
    slots, max_len = [2, 0, 1], max(prompts) + steps
    caches = contiguous_caches(model, 3, max_len)
    tables = [[s] for s in slots]
    batch = Batch.build(list(prompts), [0, 0, 0], slots, tables, max_len, logits="all")
    rows = list(model(torch.tensor([t for s, n in zip(seqs, prompts) for t in s[:n]]), batch, caches)
                .split(list(prompts)))
    for j in range(steps):
        batch = Batch.build([1, 1, 1], [n + j for n in prompts], slots, tables, max_len)
        out = model(torch.tensor([s[n + j] for s, n in zip(seqs, prompts)]), batch, caches)
        rows = [torch.cat([r, out[i : i + 1]]) for i, r in enumerate(rows)]
    for seq, got in zip(seqs, rows):
        alone = forward_logits(model, [seq])[0]
        assert rel_err(got, alone) <= 1e-4, rel_err(got, alone)
