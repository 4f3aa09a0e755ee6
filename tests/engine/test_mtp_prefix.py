"""MTP drafting on a cached prefix equals MTP drafting without one (vLLM's MTP with prefix caching
loses accuracy: its issues 43559 and 47194). The head's KV at a position p is written from the
target's hidden state h_p and the token at p + 1, so a request that resumes at p after another one
that went on differently there must rewrite the head's row p - 1 with its own next token. On tiny
Qwen3.5 and Qwen3-Next checkpoints with random MTP heads: a branch at a cache_prefix, a repeat and
a chat turn that resumes at the previous reply's end give the same tokens, the same drafts and the
same accepted counts as the engine without prefix caching, greedy and seeded."""

import pytest
import torch

from kvstate import SamplingParams
from tests.engine.test_mtp import VOCAB, mtp_llm, save_mtp_checkpoint
from tests.models.checks import random_ids


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def path(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    save_mtp_checkpoint(request.param, out)
    return out


def head_kv_after_prefill(llm, prompt) -> torch.Tensor:
    """The head's K at positions 0 .. len - 2 of `prompt` after its prefill step (then run to its end)."""
    llm.engine.add_request("probe", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    llm.engine.step()
    seq = next(s for s in llm.engine.scheduler.running if s.request_id == "probe")
    cache, bs = llm.engine.runner.caches[-1], llm.engine.runner.block_size
    k = torch.stack([cache.k[seq.block_table[p // bs]][p % bs] for p in range(len(prompt) - 1)])
    while llm.engine.has_unfinished():
        llm.engine.step()
    return k


def test_a_resumed_request_rewrites_the_heads_row_before_the_snapshot(path):
    plain, cached = mtp_llm(path, 2), mtp_llm(path, 2, enable_prefix_caching=True)
    doc, greedy = random_ids(VOCAB, 21, 1), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = doc + random_ids(VOCAB, 6, 2)
    reply = cached.generate([{"prompt_token_ids": first, "cache_prefix": len(doc)}], greedy)[0].token_ids
    # a branch right after the cache_prefix; the next turn after the reply's end (its row p - 1 never written)
    for prompt, p in ((doc + random_ids(VOCAB, 7, 3), len(doc)), (first + reply + random_ids(VOCAB, 3, 4), 30)):
        before = cached.stats()["prefix_cached_tokens"]
        want, got = head_kv_after_prefill(plain, prompt), head_kv_after_prefill(cached, prompt)
        assert cached.stats()["prefix_cached_tokens"] - before == p
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().amax(dim=tuple(range(1, got.dim())))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                    SamplingParams(temperature=1.0, top_k=8, seed=5, max_tokens=8, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_mtp_on_a_cached_prefix_equals_mtp_without_one(path, params):
    plain, cached = mtp_llm(path, 2), mtp_llm(path, 2, enable_prefix_caching=True)
    doc = random_ids(VOCAB, 21, 1)
    first = doc + random_ids(VOCAB, 6, 2)
    branch = doc + random_ids(VOCAB, 7, 3)  # leaves `first` right after the cache_prefix
    cached.generate([{"prompt_token_ids": first, "cache_prefix": len(doc)}], params)
    turn1 = plain.generate([first], params)[0]
    for prompt in (branch, first, first + turn1.token_ids + random_ids(VOCAB, 4, 4)):
        want, got = plain.generate([prompt], params)[0], cached.generate([prompt], params)[0]
        assert got.num_cached_tokens > 0, prompt
        assert got.token_ids == want.token_ids
        assert (got.metrics["num_draft_tokens"], got.metrics["num_accepted_tokens"]) == \
            (want.metrics["num_draft_tokens"], want.metrics["num_accepted_tokens"])
