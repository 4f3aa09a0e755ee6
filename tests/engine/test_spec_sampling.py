"""Speculative rejection sampling keeps the target distribution; prompt lookup; the config (tiny, no model).

On a vocabulary of 6 tokens with temperature and top-k, many seeded draws of one verify entry
(drafts d1, d2) are counted: the first token must follow p_0, the token after an accepted d1 must
follow p_1, after d1 d2 p_2 (chi-square, df = 5, against the 0.1% critical value 20.5). The same
counts against a wrong distribution fail the bound, so the test can fail.
"""

import pytest
import torch

from kvstate.engine.params import SamplingParams
from kvstate.engine.sampling import process_logits
from kvstate.engine.speculative.config import SpeculativeConfig
from kvstate.engine.speculative.ngram import NgramDrafter
from kvstate.engine.rejection import verify_one
from kvstate.errors import KvstateError

CRITICAL = 20.5  # chi-square, 5 degrees of freedom, p = 0.001


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = probs > 0
    if counts[~keep].sum() > 0:  # a token of probability 0 was drawn
        return float("inf")
    expected = n * probs[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum())


def test_rejection_sampling_keeps_the_target_distribution():
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    params = SamplingParams(temperature=0.9, top_k=5)
    p = process_logits(logits, [params] * 3).softmax(-1)  # [3, 6]: what plain sampling draws from
    d1 = int(p[0].argsort()[-2])  # a likely but not certain draft
    d2 = int(p[1].argmax())
    g = torch.Generator().manual_seed(1234)
    first, second, third = (torch.zeros(6) for _ in range(3))
    for _ in range(10000):
        out = verify_one(logits, [d1, d2], params, g)
        first[out[0]] += 1
        if len(out) > 1:
            assert out[0] == d1
            second[out[1]] += 1
        if len(out) > 2:
            assert out[1] == d2
            third[out[2]] += 1
    assert second.sum() > 1500 and third.sum() > 500
    assert chi2(first, p[0]) < CRITICAL
    assert chi2(second, p[1]) < CRITICAL
    assert chi2(third, p[2]) < CRITICAL
    assert chi2(first, p[1]) > CRITICAL and chi2(second, p[2]) > CRITICAL  # the bound catches wrong ones


def test_greedy_verification_keeps_the_agreeing_prefix():
    logits = torch.full((4, 5), -1.0)
    for row, best in enumerate([2, 3, 0, 4]):
        logits[row, best] = 1.0
    greedy = SamplingParams(temperature=0)
    assert verify_one(logits, [2, 3, 0], greedy, None) == [2, 3, 0, 4]  # all accepted, one more
    assert verify_one(logits, [2, 1, 0], greedy, None) == [2, 3]  # first mismatch replaced
    assert verify_one(logits, [4, 3, 0], greedy, None) == [2]


def test_prompt_lookup_continues_the_latest_longest_match():
    d = NgramDrafter(prompt_lookup_min=1, prompt_lookup_max=3)
    assert d.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], 2) == [7, 8]  # latest match of [1, 2, 3]
    assert d.lookup([4, 5, 6, 4, 5], 4) == [6, 4, 5]  # the context ends the draft
    assert d.lookup([1, 2, 3], 3) == []
    assert NgramDrafter(2, 3).lookup([1, 2, 9, 2], 2) == []  # below prompt_lookup_min


@pytest.mark.parametrize("bad, msg", [
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "integer"),
    ({"num_speculative_tokens": 2, "draft": "x"}, "unknown keys"),
    ("ngram", "dict"),
])
def test_bad_configs_are_one_clear_error(bad, msg):
    with pytest.raises(KvstateError, match=msg):
        SpeculativeConfig.from_dict(bad)


def test_vllm_names_are_read():
    c = SpeculativeConfig.from_dict({"model": "/m", "num_speculative_tokens": 5})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/m", 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
                                     "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 5)
