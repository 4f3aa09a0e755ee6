"""Penalties with vLLM's meaning: repetition against transformers' RepetitionPenaltyLogitsProcessor
(over prompt + output), presence and frequency against their formula written out; the runner's
generators are kept per request id and dropped when asked."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from kvstate.engine.params import SamplingParams
from kvstate.engine.penalties import apply_penalties
from kvstate.engine.sampling import RequestGenerators, make_generator, sample
from kvstate.errors import KvstateError

PROMPTS = [[1, 5, 5, 9], [], [7, 2], [3]]
OUTPUTS = [[2, 2, 7], [4, 4, 4, 0], [], [3, 3, 8]]


def logits(rows=4, vocab=12, seed=0):
    return torch.randn(rows, vocab, generator=make_generator(seed)) * 3


def test_repetition_penalty_is_transformers_processor_over_prompt_and_output():
    x = logits()
    for penalty in (1.5, 0.6):
        params = [SamplingParams(repetition_penalty=penalty)] * 4
        got = apply_penalties(x, params, PROMPTS, OUTPUTS)
        for i in range(4):
            seen = torch.tensor([PROMPTS[i] + OUTPUTS[i]]) if PROMPTS[i] + OUTPUTS[i] else torch.zeros(1, 0).long()
            want = RepetitionPenaltyLogitsProcessor(penalty)(seen, x[i : i + 1].clone())
            torch.testing.assert_close(got[i : i + 1], want, rtol=0, atol=0)


def test_presence_and_frequency_penalties_follow_the_formula():
    x = logits()
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams(frequency_penalty=-1.0),
              SamplingParams(presence_penalty=2.0), SamplingParams()]
    got = apply_penalties(x, params, PROMPTS, OUTPUTS)
    for i, p in enumerate(params):
        for t in range(x.shape[1]):
            count = OUTPUTS[i].count(t)  # the prompt does not count for these two
            want = float(x[i, t]) - p.frequency_penalty * count - p.presence_penalty * (count > 0)
            assert float(got[i, t]) == pytest.approx(want, abs=1e-6), (i, t)


def test_greedy_rows_see_the_penalties_and_logprobs_stay_raw():
    x = torch.zeros(1, 6)
    x[0, 3], x[0, 1] = 2.0, 1.5  # token 3 wins unless penalized
    p = SamplingParams(temperature=0, presence_penalty=1.0, logprobs=0)
    out = sample(x, [p], history=([[0]], [[3]]))
    assert out.token_ids == [1]
    assert out.logprobs[0] == pytest.approx(float(x.log_softmax(-1)[0, 1]))
    with pytest.raises(ValueError, match="history"):
        sample(x, [p])


@pytest.mark.parametrize("kwargs, message", [
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
    ({"n": 0}, "n must be >= 1"),
])
def test_new_params_are_validated(kwargs, message):
    with pytest.raises(KvstateError, match=message):
        SamplingParams(**kwargs)


def test_params_coerce_dicts_and_samples_get_their_own_seed():
    assert SamplingParams.coerce({"temperature": 0, "n": 2}) == SamplingParams(temperature=0, n=2)
    assert SamplingParams.coerce(None) == SamplingParams()
    with pytest.raises(KvstateError, match="no field 'temp'"):
        SamplingParams.coerce({"temp": 0})
    with pytest.raises(KvstateError, match="SamplingParams or a dict"):
        SamplingParams.coerce(3)
    p = SamplingParams(seed=5, n=3)
    assert [(q.n, q.seed) for q in map(p.for_sample, range(3))] == [(1, 5), (1, 6), (1, 7)]
    assert SamplingParams(n=2).for_sample(1).seed is None


def test_request_generators_live_per_request_until_dropped():
    gens = RequestGenerators()
    seeded, free = SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=1.0)
    a = gens.get(["a", "b"], [seeded, free])
    assert a[1] is None and len(gens) == 1 and gens.get(["a"], [seeded])[0] is a[0]
    gens.drop(["a", "unknown"])
    assert len(gens) == 0 and gens.get(["a"], [seeded])[0] is not a[0]
