"""`cache_salt` and cache reports on the tiny checkpoints of four families (Qwen3.5, Kimi Linear,
Nemotron-H-style Mamba-2, Jamba), with n-gram speculation on as well: outputs equal the plain
engine's, different salts share 0 tokens, the same salt's second send computes one token, every
output carries a report, and a prompt dict with an unknown key fails naming the key."""

from __future__ import annotations

import pytest

from kvstate import LLM, SamplingParams
from tests.engine.test_engine import VOCAB
from tests.engine.test_prefix_caching import path  # noqa: F401  (the four families' checkpoints)
from tests.models.checks import random_ids

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_salts_isolate_and_outputs_stay_exact(path, spec):  # noqa: F811
    kw = dict(cache_memory="16MiB", block_size=4, speculative_config=spec)
    plain, cached = LLM(path, **kw), LLM(path, enable_prefix_caching=True, **kw)
    doc = random_ids(VOCAB, 40, 7)
    want = plain.generate([doc], GREEDY)[0]
    assert want.cache_report.reason == "caching_off" and want.cache_report.reused_tokens == 0
    a = cached.generate([{"prompt_token_ids": doc, "cache_salt": "a"}], GREEDY)[0]
    b = cached.generate([doc], GREEDY, cache_salt="b")[0]
    none = cached.generate([doc], GREEDY)[0]
    again = cached.generate([{"prompt_token_ids": doc}], GREEDY, cache_salt="a")[0]
    for out in (a, b, none, again):
        assert out.token_ids == want.token_ids
    assert (a.num_cached_tokens, b.num_cached_tokens, none.num_cached_tokens) == (0, 0, 0)
    assert b.cache_report.reason == none.cache_report.reason == "salt_mismatch"
    assert again.num_cached_tokens == len(doc) - 1 and again.cache_report.reason is None  # computes 1 token
    stats = cached.stats()
    assert stats["prefix_misses_salt_mismatch"] == 2 and stats["prefix_misses_no_match"] == 1


def test_unknown_prompt_keys_and_bad_salts_fail_that_prompt(path):  # noqa: F811
    llm = LLM(path, cache_memory="16MiB", block_size=4, enable_prefix_caching=True)
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3], "cache_sault": "x"}, [4, 5, 6],
                         {"prompt_token_ids": [1, 2], "cache_salt": ""}], GREEDY)
    assert outs[0].finish_reason == "error" and "'cache_sault'" in outs[0].error
    assert outs[1].finish_reason == "length" and outs[1].cache_report.reason == "no_match"
    assert outs[2].finish_reason == "error" and "cache_salt" in outs[2].error
    out = llm.generate([[1, 2]], GREEDY, cache_salt=7)[0]
    assert out.finish_reason == "error" and "cache_salt must be a non-empty string" in out.error
