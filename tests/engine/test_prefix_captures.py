"""Snapshots inside a prefill chunk on the four families' tiny checkpoints (Qwen3.5, Kimi Linear,
Nemotron-H-style Mamba-2, Jamba), with n-gram speculation and a draft model on as well (MTP:
test_mtp_prefix): a first request runs the same
chunks with prefix caching on (snapshot points from cache_prefix, the interval and the repeat) as
with it off, the step asks for the states at those points, and requests that resume from each of
them give the plain engine's tokens."""

from __future__ import annotations

import pytest

from kvstate import LLM, SamplingParams
from tests.engine.test_engine import VOCAB
from tests.engine.test_prefix_caching import path  # noqa: F401  (the four families' checkpoints)
from tests.models.checks import random_ids

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}


def steps_of(llm, prompt):
    """(tokens per step, captures per step) of one request run alone, and its output."""
    sizes, captures = [], []
    step = llm.engine.step

    def recording():
        outs = step()
        sizes.append(list(llm.engine.last_step.num_tokens))
        captures.append([(k, s) for _, k, s in llm.engine.last_step.captures])
        return outs

    llm.engine.step = recording
    try:
        out = llm.generate([prompt], GREEDY)[0]
    finally:
        llm.engine.step = step
    return sizes, captures, out


@pytest.mark.parametrize("spec", [None, NGRAM, "draft"], ids=["plain", "ngram", "draft model"])
def test_first_request_runs_the_same_chunks_and_later_ones_resume_exactly(path, spec):  # noqa: F811
    if spec == "draft":  # the checkpoint drafts for itself: every verify entry carries its drafts
        spec = {"model": str(path), "num_speculative_tokens": 3}
    kw = dict(cache_memory="16MiB", block_size=4, speculative_config=spec, max_num_batched_tokens=32)
    plain = LLM(path, **kw)
    cached = LLM(path, enable_prefix_caching=True, snapshot_interval=16, **kw)
    doc = random_ids(VOCAB, 45, 11)
    want_sizes, _, want = steps_of(plain, doc)
    sizes, captures, got = steps_of(cached, {"prompt_token_ids": doc, "cache_prefix": [7, 21, 35]})
    assert got.token_ids == want.token_ids and sizes == want_sizes  # chunks of 32 and 13 either way
    # inside chunk 1 (tokens 0-31): 7, 16, 21; inside chunk 2 (32-44): 35 and the repeat's 44 (32: its end)
    assert [[k for k, _ in c] for c in captures[:2]] == [[7, 16, 21], [35 - 32, 44 - 32]]
    for p in (7, 16, 21, 32, 35):
        prompt = doc[:p] + random_ids(VOCAB, 6, p)
        out = cached.generate([prompt], GREEDY)[0]
        assert out.num_cached_tokens == p and out.cache_report.source_position == p, p
        assert out.token_ids == plain.generate([prompt], GREEDY)[0].token_ids, p
    again = cached.generate([doc], GREEDY)[0]
    assert again.num_cached_tokens == len(doc) - 1 and again.token_ids == want.token_ids
