"""The engine end to end on tiny random checkpoints of four families: Qwen3.5 (Gated DeltaNet +
attention), Mamba-2, Kimi Linear (KDA + MLA) and Jamba (Mamba-1 + attention).

16 requests of mixed lengths arrive over time; a small token budget forces chunked prefill and a
small cache forces preemption and recompute. Every request must still get exactly the greedy
tokens it gets alone and the tokens transformers' generate() gives. The pools hold the bytes
that the families' cache layouts, written out here from the transformers configs, predict.
"""

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from kvstate import LLM, SamplingParams
from kvstate.cache.spec import cache_spec
from tests.greedy import greedy_generate
from tests.arrivals import run_arrivals
from tests.models.checks import random_ids, redraw_weights
from tests.models.test_jamba import tiny as tiny_jamba
from tests.models.test_kimi_linear import make as tiny_kimi
from tests.models.test_mamba2 import tiny as tiny_mamba2

VOCAB = 101
NEW = 10
LENGTHS = [5, 30, 17, 3, 60, 9, 22, 41, 8, 13, 27, 2, 35, 19, 11, 50]


def tiny_qwen3_5(vocab: int = VOCAB):
    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=32, linear_value_head_dim=48, intermediate_size=96,
                            layer_types=["linear_attention", "full_attention"] * 2)
    hf = Qwen3_5ForCausalLM(cfg).eval()
    redraw_weights(hf, 0)
    return hf


FAMILIES = {"qwen3_5": tiny_qwen3_5, "mamba2": tiny_mamba2, "kimi_linear": lambda: tiny_kimi("groups-first2dense"),
            "jamba": lambda: tiny_jamba("head32")}
F32 = 4  # bytes


def cache_layout(family: str, cfg) -> tuple[int, int]:
    """(KV bytes per token, state bytes per sequence) of a family's cache in fp32, from its
    transformers config: what transformers' own caches hold, written out apart from kvstate's spec."""
    if family == "qwen3_5":
        attn = cfg.layer_types.count("full_attention")
        linear = cfg.layer_types.count("linear_attention")
        kv = attn * 2 * cfg.num_key_value_heads * cfg.head_dim  # K and V
        key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        conv = (2 * key_dim + value_dim) * cfg.linear_conv_kernel_dim  # q, k, v through one short conv
        return F32 * kv, F32 * linear * (state + conv)
    if family == "mamba2":
        inner = cfg.expand * cfg.hidden_size
        state = cfg.num_heads * cfg.head_dim * cfg.state_size
        conv = (inner + 2 * cfg.n_groups * cfg.state_size) * cfg.conv_kernel  # x, B, C
        return 0, F32 * cfg.num_hidden_layers * (state + conv)
    if family == "kimi_linear":
        mla = cfg.layer_types.count("full_attention")
        kda = cfg.layer_types.count("linear_attention")
        kv = mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # MLA caches the compressed latent and the rope key
        width = cfg.linear_num_heads * cfg.linear_head_dim
        state = cfg.linear_num_heads * cfg.linear_head_dim * cfg.linear_head_dim
        conv = 3 * width * cfg.linear_conv_kernel_dim  # separate q, k, v short convs
        return F32 * kv, F32 * kda * (state + conv)
    if family == "jamba":
        attn = sum(1 for i in range(cfg.num_hidden_layers) if i % cfg.attn_layer_period == cfg.attn_layer_offset)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        kv = attn * 2 * cfg.num_key_value_heads * head_dim
        inner = cfg.mamba_expand * cfg.hidden_size
        state, conv = inner * cfg.mamba_d_state, inner * cfg.mamba_d_conv
        return F32 * kv, F32 * (cfg.num_hidden_layers - attn) * (state + conv)
    raise KeyError(family)


def saved(families: dict, request, tmp_path_factory):
    """(path, transformers model, family) of the tiny checkpoint `families[request.param]()` saves."""
    hf = families[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path, hf, request.param


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    return saved(FAMILIES, request, tmp_path_factory)


def small_llm(path, num_seqs=6, blocks=24, block_size=4, budget=24):
    """An engine whose pools hold `num_seqs` state slots and about `blocks` KV blocks."""
    probe = LLM(path, cache_memory="64MiB", block_size=block_size, max_num_seqs=num_seqs)
    spec = probe.runner.cache_spec
    budget_bytes = num_seqs * spec.state_bytes + blocks * block_size * spec.kv_bytes_per_token
    return LLM(path, cache_memory=budget_bytes, block_size=block_size, max_num_seqs=num_seqs,
               max_num_batched_tokens=budget)


def test_arrivals_chunked_prefill_and_preemption_give_exact_greedy_tokens(checkpoint):
    path, hf, _ = checkpoint
    llm = small_llm(path)
    core = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    prompts = [random_ids(VOCAB, n, i) for i, n in enumerate(LENGTHS)]
    done, streamed = run_arrivals(core, prompts, greedy, first=4)  # 4 at once, then one every other step
    assert all(o.finish_reason == "length" for o in done.values())
    kv_layers = llm.runner.cache_spec.kv_bytes_per_token > 0
    if kv_layers:  # a model without KV layers never runs out of blocks
        preemptions = sum(o.metrics["num_preemptions"] for o in done.values())
        assert preemptions > 0, "the small cache should have forced a preemption"
    for i, p in enumerate(prompts):
        alone = greedy_generate(llm.model, p, NEW)
        mask = torch.ones(1, len(p), dtype=torch.long)
        ref = hf.generate(torch.tensor([p]), attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                          do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert done[i].token_ids == streamed[i] == alone == ref


def test_pools_hold_exactly_what_the_planner_predicts(checkpoint):
    path, hf, family = checkpoint
    kv_per_token, state_per_seq = cache_layout(family, hf.config)
    budget, block_size, seqs = 3 * 2**20, 8, 5
    llm = LLM(path, cache_memory=budget, block_size=block_size, max_num_seqs=seqs)
    held = llm.runner.pool_bytes  # the bytes of the pool tensors allocated
    blocks = (budget - seqs * state_per_seq) // (block_size * kv_per_token) if kv_per_token else None
    assert held["state"] == seqs * state_per_seq
    assert held["kv"] == (blocks * block_size * kv_per_token if kv_per_token else 0)
    if kv_per_token:
        assert llm.runner.sizes.num_blocks == blocks
    # the planner (`kvstate memory`) counts the same bytes for one request of 100 tokens
    spec = cache_spec(llm.plan, kv_dtype="float32", state_dtype="float32", conv_dtype="float32")
    assert spec.request_bytes(100) == state_per_seq + 100 * kv_per_token


def test_bad_requests_are_rejected_and_the_rest_served(checkpoint):
    path, _, _ = checkpoint
    llm = LLM(path, cache_memory="16MiB", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([[1, 2, 3], [5] * 100, [1, VOCAB + 7], [4, 5, 6, 7]], params)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert "64" in outs[1].error and str(VOCAB + 7) in outs[2].error
    assert outs[0].token_ids == greedy_generate(llm.model, [1, 2, 3], 4)


def test_stream_yields_the_tokens_of_generate(checkpoint):
    path, _, _ = checkpoint
    llm = LLM(path, cache_memory="16MiB")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [random_ids(VOCAB, n, 40 + n) for n in (7, 3, 12)]
    tokens = {i: [] for i in range(3)}
    finals = {}
    for ev in llm.stream(prompts, params):
        if ev.finished:
            finals[ev.index] = ev.output
        else:
            tokens[ev.index].append(ev.token_id)
    assert sorted(finals) == [0, 1, 2]
    for i in range(3):
        assert tokens[i] == finals[i].token_ids == greedy_generate(llm.model, prompts[i], 6)
        m = finals[i].metrics
        assert m["time_to_first_token"] is not None and m["time_to_first_token"] >= 0


def test_seeded_sampling_does_not_depend_on_the_batch(checkpoint):
    path, _, _ = checkpoint
    llm = LLM(path, cache_memory="16MiB")
    p = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate([[3, 1, 4, 1, 5]], p)[0].token_ids
    other = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    together = llm.generate([[9, 2, 6], [3, 1, 4, 1, 5], [5, 3, 5, 8, 9, 7]], [other, p, other])
    assert together[1].token_ids == alone


def test_slot_copies_of_the_step_are_carried_out_before_the_forward(checkpoint):
    path, _, _ = checkpoint
    core = LLM(path, cache_memory="16MiB", max_num_seqs=4).engine
    core.add_request("a", random_ids(VOCAB, 9, 3), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    core.step()  # prefill: a's state is in its slot
    src = core.scheduler.running[0].state_slot
    dst = core.scheduler.slots.copy_slot(src)  # a snapshot, as prefix caching will take them
    pools = [t for c in core.runner.caches for t in (c.state, c.conv) if t is not None]
    before = [t[src].clone() for t in pools]
    core.step()  # copies first, then a decodes (its own slot moves on)
    assert pools and all(torch.equal(t[dst], b) for t, b in zip(pools, before))
    assert any(not torch.equal(t[src], b) for t, b in zip(pools, before))
    core.scheduler.slots.free(dst)
