"""Kimi Linear: KDA + MLA (no RoPE) + sigmoid-routed MoE with shared experts, equal to transformers.

The tiny checkpoints are transformers' own KimiLinearForCausalLM with its weights redrawn at unit
scale (the default init of std 0.02 leaves the mixers' outputs too small for a wrong detail to
move the logits past the tolerance), saved with save_pretrained (which writes the original
checkpoint format: block_sparse_moe, per-expert w1/w2/w3, separate q/k/v short convs).
"""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from kvstate.cache.pools import allocate_pools
from kvstate.cache.spec import cache_spec
from kvstate.models.batch import Batch
from kvstate.models.generate import forward_logits
from kvstate.models.loader import load_model
from tests.models.checks import (check_all, check_bundled_config_builds_as_planned, check_load_fails, random_ids,
                                 redraw_weights, rel_err, save_and_load)

VOCAB = 101
TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
# awkward on purpose: KDA heads of 32 and 48, MLA q/k heads of 32 + 16 = 48 and v heads of 48, two
# MLA layers, four or six experts (top-2) in groups, dense layers first or interleaved, no shared expert
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=48, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, layer_types=TYPES)
CASES = {
    "groups-first2dense": dict(linear_num_heads=3, linear_head_dim=32, n_group=2, topk_group=1,
                               first_k_dense_replace=2),
    "qlora-bias-2shared": dict(linear_num_heads=2, linear_head_dim=48, linear_conv_kernel_dim=3, q_lora_rank=40,
                               attention_bias=True, n_shared_experts=2, norm_topk_prob=False,
                               routed_scaling_factor=1.5, mlp_layer_types=["sparse", "dense", "sparse", "dense",
                                                                           "sparse"]),
    "6experts-3groups-noshared": dict(linear_num_heads=4, linear_head_dim=32, linear_conv_kernel_dim=2,
                                      num_local_experts=6, n_group=3, topk_group=2, n_shared_experts=0),
}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread avoids OpenMP oversubscription on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make(case: str, seed: int = 0) -> KimiLinearForCausalLM:
    torch.manual_seed(seed)
    cfg = KimiLinearConfig(**{**BASE, **CASES[case]})
    hf = KimiLinearForCausalLM(cfg).eval()
    redraw_weights(hf, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # decay rates exp(A_log) in [0.05, 1]: from KDA's init (1 to 16) most heads would forget at once
        for a_log in (p for name, p in hf.named_parameters() if name.endswith("A_log")):
            a_log.copy_(torch.empty(a_log.shape).uniform_(0.05, 1.0, generator=g).log())
        if cfg.q_lora_rank:  # tiny latents, where the latent norms' eps (1e-6, not rms_norm_eps) matters
            for i in (1, 4):
                attn = hf.model.layers[i].self_attn
                attn.q_a_proj.weight.mul_(1e-3)
                attn.q_a_proj.bias.mul_(1e-3)
                attn.kv_a_proj_with_mqa.weight[: cfg.kv_lora_rank].mul_(1e-3)
                attn.kv_a_proj_with_mqa.bias[: cfg.kv_lora_rank].mul_(1e-3)
    return hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The first case saved once: (transformers model, checkpoint dir)."""
    hf = make("groups-first2dense")
    path = tmp_path_factory.mktemp("kimi")
    hf.save_pretrained(path)
    return hf, path


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # zero-width shared expert
@pytest.mark.parametrize("case", list(CASES))
def test_kimi_linear_matches_transformers(tmp_path, case):
    hf = make(case, seed=list(CASES).index(case))
    model, plan = save_and_load(hf, tmp_path)
    assert plan.layer_string == "KLKKL"
    assert [layer.ffn.kind == "moe" for layer in plan.layers] == [t == "sparse" for t in hf.config.mlp_layer_types]
    check_all(model, hf, VOCAB)


@torch.inference_mode()
def test_paged_chunked_prefill_and_batched_decode_equal_full(saved):
    """Three sequences in small scattered KV blocks and permuted state slots: a packed prefill in two
    chunks (the second continues from cached latents and states), then batched decode steps (the
    absorbed MLA and the recurrent KDA with N > 1), equal each sequence's own full forward."""
    model, plan = load_model(saved[1])
    chunks, steps, bs = ((5, 2, 8), (4, 1, 6)), 6, 4
    prompts = [a + b for a, b in zip(*chunks)]
    seqs = [random_ids(VOCAB, n + steps, 20 + i) for i, n in enumerate(prompts)]
    tables = [[5, 0, 9, 2, 11], [7, 3, 12], [1, 8, 4, 10, 6]]  # enough blocks of 4 for every length
    slots = [2, 0, 1]
    spec = cache_spec(plan, kv_dtype="float32", conv_dtype="float32")
    caches = allocate_pools(spec, num_blocks=13, block_size=bs, num_slots=3)
    got = [[] for _ in seqs]
    done = [0, 0, 0]
    for lens in chunks:
        batch = Batch.build(list(lens), done, slots, tables, bs, logits="all")
        out = model(torch.tensor([t for s, c, n in zip(seqs, done, lens) for t in s[c : c + n]]), batch, caches)
        for i, rows in enumerate(out.split(list(lens))):
            got[i].append(rows)
        done = [c + n for c, n in zip(done, lens)]
    for step in range(steps):
        ctx = [n + step for n in prompts]
        batch = Batch.build([1, 1, 1], ctx, slots, tables, bs)
        out = model(torch.tensor([s[c] for s, c in zip(seqs, ctx)]), batch, caches)
        for i in range(3):
            got[i].append(out[i : i + 1])
    for seq, rows in zip(seqs, got):
        full = forward_logits(model, [seq])[0]
        assert rel_err(torch.cat(rows), full) <= 1e-4


def test_transformers_in_memory_names_load_the_same(saved, tmp_path):
    """transformers' own parameter names (fused conv1d, forget_gate.*, mlp.experts.gate_up_proj) load too."""
    hf, path = saved
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ids = random_ids(VOCAB, 30, 5)
    original, _ = load_model(path)
    renamed, _ = load_model(tmp_path)
    assert torch.equal(forward_logits(renamed, [ids])[0], forward_logits(original, [ids])[0])


def test_original_config_format_reads_the_same(saved, tmp_path):
    """The released config's shape (linear_attn_config with 1-indexed layer lists, first_k_dense_replace,
    model_max_length, head_dim 72-style decoys) builds the same model as transformers' flat export."""
    hf, path = saved
    cfg = json.loads((path / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        cfg.pop(key)
    cfg.update(head_dim=72, mla_use_nope=True, first_k_dense_replace=2,
               linear_attn_config={"full_attn_layers": [2, 5], "kda_layers": [1, 3, 4], "num_heads": 3, "head_dim": 32,
                                   "short_conv_kernel_size": 4})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    ids = random_ids(VOCAB, 30, 6)
    flat, _ = load_model(path)
    original, plan = load_model(tmp_path)
    assert plan.layer_string == "KLKKL" and plan.max_position_embeddings == 1048576
    assert torch.equal(forward_logits(original, [ids])[0], forward_logits(flat, [ids])[0])


def test_missing_conv_is_named(saved, tmp_path):
    check_load_fails(saved[1], lambda t: t.pop("model.layers.2.self_attn.k_conv1d.weight"),
                     r"missing tensors for layers\.2\.mixer\.conv_weight", dest=tmp_path)


def test_wrong_latent_shape_is_named(saved, tmp_path):
    key = "model.layers.1.self_attn.kv_b_proj.weight"
    check_load_fails(saved[1], lambda t: t.__setitem__(key, torch.zeros(320, 20)), rf"{key}.*shape \(320, 20\)",
                     dest=tmp_path)


def test_unknown_tensor_is_named(saved, tmp_path):
    key = "model.layers.0.self_attn.q_rope.weight"
    check_load_fails(saved[1], lambda t: t.__setitem__(key, torch.zeros(3)), key, dest=tmp_path)


@pytest.mark.parametrize("source", ["kimi-linear-48b-a3b", "tiny"])
def test_cache_shapes_agree_with_cache_spec(saved, source):
    """The pools the model asks for are exactly what the planner's cache spec counts (real and tiny
    dims), and the model has as many parameters as the planner estimates."""
    model, plan = check_bundled_config_builds_as_planned(saved[1] if source == "tiny" else source)
    assert plan.layer_string == ("KLKKL" if source == "tiny" else "KKKLKKKLKKKLKKKLKKKLKKKLKKL")
    if source != "tiny":
        spec = cache_spec(plan, kv_dtype="float32", state_dtype="float32", conv_dtype="float32")
        assert spec.kv_bytes_per_token == 7 * 576 * 4  # 7 MLA layers, one latent of 512 + 64 each
        caches = allocate_pools(spec, num_blocks=0, block_size=16, num_slots=0)
        assert sum(c.latent is not None for c in caches) == 7
