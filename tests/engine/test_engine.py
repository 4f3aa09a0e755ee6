"""The engine end to end on tiny random checkpoints of two families (Gated DeltaNet and Mamba-2).

16 requests of mixed lengths arrive over time; a small token budget forces chunked prefill and a
small cache forces preemption and recompute. Every request must still get exactly the greedy
tokens it gets alone and the tokens transformers' generate() gives.
"""

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from kvstate import LLM, SamplingParams
from kvstate.cache.spec import cache_spec
from kvstate.models.generate import greedy_generate
from tests.models.checks import random_ids, redraw_weights
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


FAMILIES = {"qwen3_5": tiny_qwen3_5, "mamba2": tiny_mamba2}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    hf = FAMILIES[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path, hf


def small_llm(path, num_seqs=6, blocks=24, block_size=4, budget=24):
    """An engine whose pools hold `num_seqs` state slots and about `blocks` KV blocks."""
    probe = LLM(path, cache_memory="64MiB", block_size=block_size, max_num_seqs=num_seqs)
    spec = probe.runner.spec
    budget_bytes = num_seqs * spec.state_bytes + blocks * block_size * spec.kv_bytes_per_token
    return LLM(path, cache_memory=budget_bytes, block_size=block_size, max_num_seqs=num_seqs,
               max_num_batched_tokens=budget)


def test_arrivals_chunked_prefill_and_preemption_give_exact_greedy_tokens(checkpoint):
    path, hf = checkpoint
    llm = small_llm(path)
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    prompts = [random_ids(VOCAB, n, i) for i, n in enumerate(LENGTHS)]
    seqs, done, step = [], [], 0
    while len(done) < len(prompts):
        if len(seqs) < len(prompts) and (step == 0 or step % 2 == 0):  # 4 at once, then one every other step
            for p in prompts[len(seqs): 4 if step == 0 else len(seqs) + 1]:
                seqs.append(llm.add_request(p, greedy))
        done += llm.step()
        step += 1
    assert all(s.finish_reason == "length" for s in seqs)
    kv_layers = llm.runner.spec.kv_bytes_per_token > 0
    if kv_layers:  # a model without KV layers never runs out of blocks
        assert sum(s.num_preemptions for s in seqs) > 0, "the small cache should have forced a preemption"
    for p, s in zip(prompts, seqs):
        alone = greedy_generate(llm.model, p, NEW)
        mask = torch.ones(1, len(p), dtype=torch.long)
        ref = hf.generate(torch.tensor([p]), attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                          do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert s.output_token_ids == alone == ref


def test_pools_hold_exactly_what_the_planner_predicts(checkpoint):
    path, _ = checkpoint
    llm = LLM(path, cache_memory="3MiB", block_size=8, max_num_seqs=5)
    spec = cache_spec(llm.plan, kv_dtype="float32", state_dtype="float32", conv_dtype="float32")
    sizes = llm.runner.sizes
    held = llm.runner.pool_bytes
    assert held["state"] == 5 * spec.state_bytes
    assert held["kv"] == sizes.num_blocks * 8 * spec.kv_bytes_per_token
    assert held["kv"] + held["state"] <= 3 * 2**20
    if spec.kv_bytes_per_token:  # the budget left after the slots is used by blocks, less than one block spare
        assert 3 * 2**20 - held["kv"] - held["state"] < 8 * spec.kv_bytes_per_token
    # the planner's per-request arithmetic is the engine's: one request of n tokens = state + n * kv/token
    assert spec.request_bytes(100) == spec.state_bytes + 100 * spec.kv_bytes_per_token


def test_bad_requests_are_rejected_and_the_rest_served(checkpoint):
    path, _ = checkpoint
    llm = LLM(path, cache_memory="16MiB", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([[1, 2, 3], [5] * 100, [1, VOCAB + 7], [4, 5, 6, 7]], params)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert "64" in outs[1].error and str(VOCAB + 7) in outs[2].error
    assert outs[0].token_ids == greedy_generate(llm.model, [1, 2, 3], 4)


def test_stream_yields_the_tokens_of_generate(checkpoint):
    path, _ = checkpoint
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
    path, _ = checkpoint
    llm = LLM(path, cache_memory="16MiB")
    p = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate([[3, 1, 4, 1, 5]], p)[0].token_ids
    other = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    together = llm.generate([[9, 2, 6], [3, 1, 4, 1, 5], [5, 3, 5, 8, 9, 7]], [other, p, other])
    assert together[1].token_ids == alone
