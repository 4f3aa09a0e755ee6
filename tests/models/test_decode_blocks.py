"""The compiled decode blocks (`kvstate.models.decode_blocks`: one extension call per block) give
the per-op path's logits bit for bit: Qwen3.5 (Gated DeltaNet, gated attention with q/k norms and
partial rotary) and Llama (plain attention), fp32, bf16 and int8 weights, one sequence and a batch in
scattered slots; blocks they cannot serve (MoE) run op by op in the same step; a plan whose
weights were replaced since is built again. Speculative decoding's verify steps (decode and verify
entries, one query per token row) run compiled too: the same logits, pools and rollback states."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from kvstate.layers.recurrence import keep_states
from kvstate.models import decode_blocks
from kvstate.models.batch import Batch
from kvstate.models.generate import contiguous_caches
from kvstate.models.build import fuse_projections, set_weight_dtype
from kvstate.models.loader import load_model
from tests.kernels.conftest import extension
from tests.models.checks import random_ids, redraw_weights
from tests.models.test_decode_kernels import _decode_logits
from tests.models.test_qwen3_5 import TEXT, VOCAB, tiny_moe


def _saved(hf, path):
    redraw_weights(hf, 0)
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch.manual_seed(0)
    qwen = Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=96, **TEXT)).eval()
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    return {"qwen3_5": _saved(qwen, tmp_path_factory.mktemp("qwen")),
            "llama": _saved(llama, tmp_path_factory.mktemp("llama")),
            "moe": _saved(tiny_moe(0), tmp_path_factory.mktemp("moe"))}


def _both(model, n: int):
    """(per-op logits, compiled logits) [steps, n, vocab] of the same prefill and decode steps."""
    prompts = [[(7 * i + 3 * j + 1) % VOCAB for j in range(11)] for i in range(n)]
    slots = [6, 1, 4, 0, 3][:n]
    with decode_blocks.per_op():
        ref = _decode_logits(model, prompts, 6, slots)
    return ref, _decode_logits(model, prompts, 6, slots)


@pytest.mark.parametrize("name", ["qwen3_5", "llama"])
@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("n", [1, 5])
def test_compiled_blocks_equal_per_op_bitwise(checkpoints, name, weights, n, monkeypatch):
    extension()
    model, _ = load_model(checkpoints[name], weight_dtype=weights)
    ran = []
    real = decode_blocks.run
    monkeypatch.setattr(decode_blocks, "run", lambda entry, *a: ran.append(entry[0]) or real(entry, *a))
    ref, got = _both(model, n)
    assert len(ran) == 6 * len(model.layers)  # every block of these two families, every decode step
    assert torch.equal(got, ref)


def test_blocks_it_cannot_serve_run_op_by_op(checkpoints, monkeypatch):
    extension()
    model, _ = load_model(checkpoints["moe"])
    assert decode_blocks.plan(model)[0] == [None] * len(model.layers)  # MoE FFNs: not served
    qwen, _ = load_model(checkpoints["qwen3_5"])
    real = decode_blocks.plan
    mixed = lambda m: ([None if i in (1, 2) else p for i, p in enumerate(real(m)[0])], real(m)[1])  # noqa: E731
    monkeypatch.setattr(decode_blocks, "plan", mixed)
    ref, got = _both(qwen, 3)
    assert torch.equal(got, ref)


def test_plan_is_rebuilt_when_the_weights_change(checkpoints):
    extension()
    model, _ = load_model(checkpoints["qwen3_5"])
    _both(model, 1)
    first = model._decode_blocks
    set_weight_dtype(model, torch.bfloat16)  # new weight tensors: the fused groups are stale
    fuse_projections(model)
    ref, got = _both(model, 1)
    assert model._decode_blocks is not first
    assert torch.equal(got, ref)
    bf16, _ = load_model(checkpoints["qwen3_5"], weight_dtype="bf16")
    assert torch.equal(got, _both(bf16, 1)[0])


def test_a_block_with_forward_hooks_runs_op_by_op(checkpoints):
    # tensor parallelism adds its all-reduce as a forward hook on the mixer and the MLP: a compiled
    # block would skip it
    extension()
    model, _ = load_model(checkpoints["qwen3_5"])
    model.layers[1].mixer.register_forward_hook(lambda module, args, out: 2 * out)
    plans, _ = decode_blocks.plan(model)
    assert plans[1] is None and all(p is not None for i, p in enumerate(plans) if i != 1)
    ref, got = _both(model, 2)
    assert torch.equal(got, ref)


@torch.inference_mode()
def _verify_step(model, n: int):
    """Prefill n prompts, one step of verify entries (3 tokens; entry 1 a plain decode), keep 2 tokens
    of each verify entry, one decode step -> (both steps' logits, every pool after them)."""
    plen, max_len, slots = 9, 16, [5, 0, 3][:n]
    caches = contiguous_caches(model, max(slots) + 1, max_len)
    tables = [[s] for s in slots]
    prompts = [random_ids(VOCAB, plen, 30 + i) for i in range(n)]
    model(torch.tensor([t for p in prompts for t in p]), Batch.build([plen] * n, [0] * n, slots, tables, max_len),
          caches)
    modes = ["decode" if i == 1 else "verify" for i in range(n)]
    tails = [random_ids(VOCAB, 1 if m == "decode" else 3, 40 + i) for i, m in enumerate(modes)]
    batch = Batch.build([len(t) for t in tails], [plen] * n, slots, tables, max_len, modes=modes)
    logits = model(torch.tensor([t for tail in tails for t in tail]), batch, caches)
    keep_states(batch, {i: 2 for i, m in enumerate(modes) if m == "verify"})
    kept = [plen + (1 if m == "decode" else 2) for m in modes]
    after = model(torch.tensor([7] * n), Batch.build([1] * n, kept, slots, tables, max_len), caches)
    pools = [t.clone() for c in caches for t in (c.k, c.v, c.state, c.conv) if t is not None]
    return logits, after, pools


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 3])
def test_verify_steps_run_compiled_and_equal_per_op_bitwise(checkpoints, weights, n, monkeypatch):
    extension()
    model, _ = load_model(checkpoints["qwen3_5"], weight_dtype=weights)
    with decode_blocks.per_op():
        ref = _verify_step(model, n)
    ran = []
    real = decode_blocks.run
    monkeypatch.setattr(decode_blocks, "run", lambda entry, *a: ran.append(entry[0]) or real(entry, *a))
    got = _verify_step(model, n)
    assert len(ran) == 2 * len(model.layers)  # the verify step and the decode after it, every block
    for a, b in zip((got[0], got[1], *got[2]), (ref[0], ref[1], *ref[2])):
        assert torch.equal(a, b)


def assert_all_compiled_equal_per_op(model, n: int, monkeypatch) -> None:
    """Every block of every decode step runs compiled, and the logits equal the per-op path's bit for bit."""
    ran = []
    real = decode_blocks.run
    monkeypatch.setattr(decode_blocks, "run", lambda entry, *a: ran.append(entry[0]) or real(entry, *a))
    ref, got = _both(model, n)
    assert len(ran) == 6 * len(model.layers)
    assert torch.equal(got, ref)


@pytest.fixture(scope="module")
def qwen_256(tmp_path_factory):
    """Qwen3.5 whose every projection has K a multiple of 256 (Q4_K blocks fit all of them)."""
    torch.manual_seed(1)
    cfg = dict(TEXT, hidden_size=256, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64)
    return _saved(Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=256, **cfg)).eval(),
                  tmp_path_factory.mktemp("qwen256"))


@pytest.mark.parametrize("weights", ["q8_0", "q4_k"])
@pytest.mark.parametrize("n", [1, 5])
def test_compiled_blocks_with_ggml_blocks_equal_per_op_bitwise(qwen_256, weights, n, monkeypatch):
    """GGML block weights (fused groups of one type) run in the compiled blocks, through the same
    block kernel as the per-op path: the same logits, bit for bit."""
    extension()
    model, _ = load_model(qwen_256, weight_dtype=weights)
    assert all(m.mixer.in_proj_qkv.weight_format == weights.upper() for m in model.layers
               if hasattr(m.mixer, "in_proj_qkv"))
    assert model.layers[0].ffn.down_proj.weight_format == weights.upper()
    assert_all_compiled_equal_per_op(model, n, monkeypatch)


@pytest.mark.parametrize("n", [1, 5])
def test_compiled_blocks_with_mixed_block_types_equal_per_op_bitwise(qwen_256, n, monkeypatch):
    """A Q4_K_M file's layers mix Q4_K and Q6_K within a fused group (GDN's in_proj_qkv, attention's
    v_proj): they fuse as `BlockParts` and still run compiled (every block, after the weights moved to
    huge pages where the OS has them), the per-op path's logits bit for bit."""
    from kvstate.kernels.blocks import set_block_weight
    from kvstate.kernels.fused import BlockParts
    from kvstate.kernels.hugepages import place_weights
    from tests.kernels.test_blocks import random_blocks

    extension()
    model, _ = load_model(qwen_256, weight_dtype="q4_k")
    for i, block in enumerate(model.layers):
        m = block.mixer
        lin = m.in_proj_qkv if hasattr(m, "in_proj_qkv") else m.v_proj
        raw = random_blocks("Q6_K", lin.out_features, lin.in_features // 256, seed=i)
        raw[:, 208:210] = (torch.full((lin.out_features, 1), 2e-4).half().view(torch.uint8).numpy())
        set_block_weight(lin, torch.from_numpy(raw), "Q6_K")
    fuse_projections(model)
    place_weights(model, min_bytes=1)
    mixed = [(b.mixer.in_proj_qkv if hasattr(b.mixer, "in_proj_qkv") else b.mixer.v_proj).fused_group
             for b in model.layers]
    assert len({id(g) for g in mixed}) == len(model.layers) and all(isinstance(g, BlockParts) for g in mixed)
    assert_all_compiled_equal_per_op(model, n, monkeypatch)
