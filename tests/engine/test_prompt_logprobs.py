"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's semantics) against transformers' log-softmax.

Tiny random checkpoints of every family (Gated DeltaNet, Mamba-2, KDA + MLA, Mamba-1 + attention,
Qwen3-Next, Nemotron-H, dense Llama): each prompt token's logprob and rank equal those of
transformers' full forward; the k alternatives are the top k there. Chunked prefill, a batch of
prompts, prefix caching on (a prompt another request already cached) and max_tokens 0 give the
same numbers; the chunked LM head never holds more positions than its chunk.
"""

import math

import pytest
import torch

from kvstate import LLM, KvstateError, SamplingParams
from kvstate.engine import prompt_logprobs as plp
from tests.engine.test_engine import tiny_qwen3_5
from tests.models.checks import random_ids
from tests.models.test_dense import _tiny_llama
from tests.models.test_jamba import tiny as tiny_jamba
from tests.models.test_kimi_linear import make as tiny_kimi
from tests.models.test_mamba2 import tiny as tiny_mamba2
from tests.models.test_nemotron_h import tiny as tiny_nemotron_h
from tests.models.test_qwen3_next import tiny as tiny_qwen3_next

VOCAB = 101
FAMILIES = {"qwen3_5": tiny_qwen3_5, "mamba2": tiny_mamba2, "kimi_linear": lambda: tiny_kimi("groups-first2dense"),
            "jamba": lambda: tiny_jamba("head32"), "qwen3_next": lambda: tiny_qwen3_next("moe-mlp-only-layer"),
            "nemotron_h": tiny_nemotron_h, "llama": _tiny_llama}
K = 3


def reference(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax [T, V] over the prompt."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)


def check_against(entries, ids, ref, k, tol=2e-4):
    assert entries[0] is None and len(entries) == len(ids)
    for p in range(1, len(ids)):
        row, entry = ref[p - 1], entries[p]
        own = entry[ids[p]]
        assert math.isclose(own.logprob, float(row[ids[p]]), abs_tol=tol)
        assert own.rank == int((row > row[ids[p]] + tol).sum()) + 1 or own.rank == int((row > row[ids[p]]).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert list(entry)[0] == ids[p] and set(entry) == {ids[p], *top}
        for tok in top:
            assert math.isclose(entry[tok].logprob, float(row[tok]), abs_tol=tol)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prompt_logprobs_equal_transformers(family, tmp_path):
    hf = FAMILIES[family]()
    hf.save_pretrained(tmp_path)
    prompts = [random_ids(VOCAB, n, 7 + n) for n in (23, 6, 1)]
    llm = LLM(tmp_path, cache_memory="16MiB", block_size=4, max_num_batched_tokens=8)  # chunked prefill
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=K))
    for ids, out in zip(prompts, outs):
        check_against(out.prompt_logprobs, ids, reference(hf, ids), K)
        assert len(out.token_ids) == 2


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("plp")
    hf = tiny_qwen3_5()
    hf.save_pretrained(path)
    return path, hf


def test_max_tokens_zero_scores_the_prompt_only(qwen):
    path, hf = qwen
    ids = random_ids(VOCAB, 12, 3)
    out = LLM(path, cache_memory="16MiB").generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    ref = reference(hf, ids)
    check_against(out.prompt_logprobs, ids, ref, 0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # k = 0: the prompt's own token only


def test_decoded_tokens_with_a_tokenizer(tmp_path):
    from tests.models.test_tokenizer import write_tokenizer

    tiny_qwen3_5(vocab=300).save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    llm = LLM(tmp_path, cache_memory="16MiB")
    out = llm.generate(["the quick brown fox"], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    for entry in out.prompt_logprobs[1:]:
        assert all(lp.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False) for t, lp in entry.items())


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(KvstateError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(KvstateError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_prefix_caching_gives_the_no_cache_numbers(qwen):
    """A prompt whose prefix another request cached is still scored at every position (1e-5)."""
    path, _ = qwen
    shared = random_ids(VOCAB, 40, 11)
    prompts = [shared + random_ids(VOCAB, 6, 12), shared + random_ids(VOCAB, 9, 13)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    plain = LLM(path, cache_memory="16MiB", block_size=4).generate(prompts, params)
    cached = LLM(path, cache_memory="16MiB", block_size=4, enable_prefix_caching=True)
    cached.generate([shared + [1, 2]], SamplingParams(temperature=0, max_tokens=4))  # fills the cache
    again = [cached.generate([p], params)[0] for p in prompts]
    for a, b in zip(plain, again):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for ea, eb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert list(ea) == list(eb)
            for t in ea:
                assert abs(ea[t].logprob - eb[t].logprob) < 1e-5 and ea[t].rank == eb[t].rank
        assert a.token_ids == b.token_ids
    plain_again = cached.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1))[0]
    assert plain_again.num_cached_tokens > 0  # requests without prompt logprobs still use the cache


def test_lm_head_runs_in_chunks_of_positions(qwen, monkeypatch):
    """Never [T, V] at once: with a chunk of 3 positions each LM-head call sees at most 3 rows."""
    path, hf = qwen
    llm = LLM(path, cache_memory="16MiB")
    monkeypatch.setattr(plp, "CHUNK_BYTES", 3 * 4 * VOCAB)
    rows = []
    head = llm.runner.model.lm_head
    handle = head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    ids = random_ids(VOCAB, 20, 5)
    try:
        out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    finally:
        handle.remove()
    assert max(rows) <= 3 and sum(rows) >= 19
    check_against(out.prompt_logprobs, ids, reference(hf, ids), 1)


def test_a_runner_that_cannot_score_prompts_refuses_the_request_alone(qwen):
    """Under TP (TPRunner.scores_prompts False) the LM head gathers from every rank: such a request is
    refused with its reason, and the requests beside it still run."""
    from kvstate.engine.config import EngineConfig
    from kvstate.engine.core import EngineCore
    from kvstate.engine.runner import ModelRunner
    from kvstate.models.loader import load_model

    class NoScoring(ModelRunner):
        scores_prompts = False

    model, plan = load_model(qwen[0])
    core = EngineCore(model, plan, config=EngineConfig(cache_memory="16MiB"), runner_class=NoScoring)
    core.add_request("scored", [1, 2, 3], SamplingParams(max_tokens=1, prompt_logprobs=1))
    core.add_request("plain", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    done = {}
    while core.has_unfinished():
        done.update({o.request_id: o.output for o in core.step() if o.finished})
    assert done["scored"].finish_reason == "error" and "tensor parallelism" in done["scored"].error
    assert len(done["plain"].token_ids) == 2


def test_preemption_and_mtp_speculation_keep_the_numbers():
    """A cache too small for both prompts (one is preempted and recomputed) and MTP drafting (the
    runner keeps every row's hidden state anyway) give the plain engine's prompt logprobs."""
    from kvstate.shipped import shipped_path

    path = shipped_path("kvstate-phonebook-hybrid")
    prompts = [random_ids(1300, 60, 21), random_ids(1300, 44, 22)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    plain = LLM(path, cache_memory="16MiB").generate(prompts, params)
    spec = LLM(path, cache_memory="16MiB").engine.runner.cache_spec
    tight = LLM(path, cache_memory=2 * spec.state_bytes + 80 * spec.kv_bytes_per_token, max_num_seqs=2,
                block_size=4, max_num_batched_tokens=16)  # 80 tokens of KV for 2 x ~55
    mtp = LLM(path, cache_memory="16MiB", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    squeezed = tight.generate(prompts, params)
    assert sum(o.metrics["num_preemptions"] for o in squeezed) > 0
    for other in (squeezed, mtp.generate(prompts, params)):
        for a, b in zip(plain, other):
            assert a.token_ids == b.token_ids
            for ea, eb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                assert list(ea) == list(eb) and all(abs(ea[t].logprob - eb[t].logprob) < 1e-4 for t in ea)
