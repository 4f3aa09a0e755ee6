"""The MTP head's forward as one compiled call (`ext.MtpHead`, decode_blocks.head_for_step) gives the
per-op head's drafts, output y, logits and KV bit for bit: fp32 and bf16 weights, one entry and a
batch in scattered slots, the tiny Qwen3.5 of the MTP tests and an awkwardly shaped one (hidden 80,
head_dim 24, vocab 101). Without the kernels (or in `per_op()`) the head runs op by op."""

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from kvstate.cache.pools import allocate_pools
from kvstate.cache.spec import cache_spec
from kvstate.kernels import backend
from kvstate.models import decode_blocks
from kvstate.models.batch import Batch
from kvstate.models.loader import load_model
from tests.kernels.conftest import extension
from tests.models.checks import random_ids, redraw_weights
from tests.models.mtp_checkpoint import TINY_QWEN3_5, add_mtp

AWKWARD = dict(TINY_QWEN3_5, hidden_size=80, head_dim=24, linear_value_head_dim=40)
SHAPES = {"tiny": TINY_QWEN3_5, "awkward": AWKWARD}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, dims in SHAPES.items():
        path = tmp_path_factory.mktemp(name)
        torch.manual_seed(0)
        hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**dims, intermediate_size=96)).eval()
        redraw_weights(hf, 0)
        hf.save_pretrained(path)
        add_mtp(path)
        out[name] = path
    return out


@torch.inference_mode()
def _head_steps(model, n: int, steps: int = 3, mode: str = "steps"):
    """Prefill n prompts of different lengths (the head over them op by op), then `steps` decode-only
    head steps chaining on y -> ([drafts, y of every step] (mode "steps"; "drafts": the drafts only;
    "chain": the drafts of one `chain_head` call), the head's K and V pools after)."""
    plens, slots = [9, 14, 5, 11][:n], [3, 0, 5, 1][:n]
    max_len = max(plens) + steps + 1
    spec = cache_spec(model.plan, kv_dtype="float32", state_dtype="float32", conv_dtype="float32", mtp=True)
    caches = allocate_pools(spec, num_blocks=6, block_size=max_len, num_slots=6)
    tables = [[s] for s in slots]
    prompts = [random_ids(model.plan.vocab_size, p, 50 + i) for i, p in enumerate(plens)]
    flat = torch.tensor([t for p in prompts for t in p])
    batch = Batch.build(plens, [0] * n, slots, tables, max_len, logits="all")
    _, hidden = model(flat, batch, caches[:-1], hidden=True)
    # the head at positions 0 .. len - 2 of each prompt (h_p, t_{p+1}), as a prefill
    rows = [o + p for o, ln in zip(batch.token_offsets, plens) for p in range(ln - 1)]
    hb = Batch.build([ln - 1 for ln in plens], [0] * n, slots, tables, max_len, logits="all")
    with decode_blocks.per_op():
        _, y = model.mtp(flat[[r + 1 for r in rows]], hidden[rows], hb, caches[-1], model.embed_tokens,
                         model.lm_head)
    last = torch.tensor(hb.token_offsets[1:]) - 1
    h, ids = y[last], torch.tensor([p[-1] for p in prompts])
    out = []
    if mode == "chain":  # the compiled chain: every step in one call
        start = torch.tensor([ln - 1 for ln in plens])
        entry = decode_blocks.compiled_head(model.mtp, model.embed_tokens, model.lm_head)
        drafts = decode_blocks.chain_head(entry, ids, h, caches[-1], start, torch.tensor(tables), max_len, steps,
                                          sum(plens))
        return list(drafts.T), caches[-1].k.clone(), caches[-1].v.clone()
    for s in range(steps):
        step = Batch.build([1] * n, [ln - 1 + s for ln in plens], slots, tables, max_len)
        drafts, y = model.mtp.draft(ids, h, step, caches[-1], model.embed_tokens, model.lm_head)
        out += [drafts] if mode == "drafts" else [drafts, y]
        ids, h = drafts, y
    return out, caches[-1].k.clone(), caches[-1].v.clone()


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("weights", ["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 4])
def test_compiled_head_equals_per_op_bitwise(checkpoints, shape, weights, n, monkeypatch):
    extension()
    model, _ = load_model(checkpoints[shape], weight_dtype=weights)
    with decode_blocks.per_op():
        ref, ref_k, ref_v = _head_steps(model, n)
    ran = []
    real = decode_blocks.run_head
    monkeypatch.setattr(decode_blocks, "run_head", lambda entry, *a: ran.append(entry) or real(entry, *a))
    got, k, v = _head_steps(model, n)
    assert len(ran) == 3  # every decode-only head step ran as one call
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 3])
def test_compiled_chain_equals_per_op_steps(checkpoints, weights, n):
    """`chain_head` (positions and KV rows from the block tables, in C++) drafts what per-op steps draft."""
    extension()
    model, _ = load_model(checkpoints["awkward"], weight_dtype=weights)
    with decode_blocks.per_op():
        ref, ref_k, ref_v = _head_steps(model, n, mode="drafts")
    got, k, v = _head_steps(model, n, mode="chain")
    assert len(got) == len(ref) == 3
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


@torch.inference_mode()
def test_compiled_head_logits_are_the_lm_head_of_y(checkpoints):
    extension()
    model, _ = load_model(checkpoints["awkward"])
    spec = cache_spec(model.plan, kv_dtype="float32", state_dtype="float32", conv_dtype="float32", mtp=True)
    caches = allocate_pools(spec, num_blocks=3, block_size=8, num_slots=3)
    step = Batch.build([1] * 3, [0, 0, 0], [2, 0, 1], [[2], [0], [1]], 8)
    ids, h = torch.tensor([5, 17, 99]), torch.randn(3, 80)
    entry = decode_blocks.head_for_step(model.mtp, step, model.embed_tokens, model.lm_head)
    assert entry is not None
    drafts, y, logits = decode_blocks.run_head(entry, ids, h, caches[-1], step.positions, step.block_tables,
                                               step.kv_indices, 3)
    with decode_blocks.per_op():
        ref, ref_y = model.mtp(ids, h, step, allocate_pools(spec, num_blocks=3, block_size=8, num_slots=3)[-1],
                               model.embed_tokens, model.lm_head)
    assert torch.equal(y, ref_y) and torch.equal(logits, ref) and torch.equal(drafts, ref.argmax(-1))


def test_without_the_kernels_the_head_runs_op_by_op(checkpoints, monkeypatch):
    model, _ = load_model(checkpoints["tiny"])
    monkeypatch.setattr(decode_blocks, "run_head", lambda *a: pytest.fail("compiled head ran"))
    with backend("torch"):
        assert decode_blocks.head_for_step(model.mtp, Batch.build([1], [0], [0], [[0]], 8), model.embed_tokens,
                                           model.lm_head) is None
        _head_steps(model, 2)


@torch.inference_mode()
def _rows_then_chain(model, compiled: bool, steps: int = 3):
    """One sequence: the head over positions 0 .. 10 op by op, then over rows 11 .. 13 (a verify's
    accepted ones) and `steps` chained drafts from the last -> (drafts, the head's K and V pools)."""
    plen, max_len, slot = 16, 8, 1  # blocks of 8: the chain runs into a third block
    spec = cache_spec(model.plan, kv_dtype="float32", state_dtype="float32", conv_dtype="float32", mtp=True)
    caches = allocate_pools(spec, num_blocks=5, block_size=max_len, num_slots=3)
    table = [4, 0, 2]
    prompt = torch.tensor(random_ids(model.plan.vocab_size, plen, 7))
    _, hidden = model(prompt, Batch.build([plen], [0], [slot], [table], max_len, logits="all"), caches[:-1],
                      hidden=True)
    with decode_blocks.per_op():
        model.mtp(prompt[1:12], hidden[:11], Batch.build([11], [0], [slot], [table], max_len), caches[-1],
                  model.embed_tokens, model.lm_head)
    rows = Batch.build([3], [11], [slot], [table], max_len, modes=["verify"])
    ids, h = prompt[12:15], hidden[11:14]
    if compiled:
        entry = decode_blocks.compiled_head(model.mtp, model.embed_tokens, model.lm_head)
        drafts = decode_blocks.run_chain_head(entry, ids.tolist(), h, caches[-1], 11, table, max_len, steps)
        return torch.tensor(drafts), caches[-1].k.clone(), caches[-1].v.clone()
    with decode_blocks.per_op():
        tokens, y = model.mtp.draft(ids, h, rows, caches[-1], model.embed_tokens, model.lm_head)
        out = [tokens[-1:]]
        for s in range(steps):
            step = Batch.build([1], [14 + s], [slot], [table], max_len)
            t, y = model.mtp.draft(out[-1], y[-1:], step, caches[-1], model.embed_tokens, model.lm_head)
            out.append(t)
    return torch.cat(out), caches[-1].k.clone(), caches[-1].v.clone()


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_rows_then_chain_in_one_call_equals_per_op(checkpoints, weights):
    """`run_chain_head` (batch 1 after a verify: the accepted rows, then the chain across a block
    boundary) drafts and writes the KV the per-op head does."""
    extension()
    model, _ = load_model(checkpoints["awkward"], weight_dtype=weights)
    ref, ref_k, ref_v = _rows_then_chain(model, False)
    got, k, v = _rows_then_chain(model, True)
    assert got.shape == (4,)
    assert torch.equal(got, ref) and torch.equal(k, ref_k) and torch.equal(v, ref_v)
