"""The batched sampler against transformers' logits warpers and direct computations: greedy is
argmax, the top-k / top-p / min-p masks are right per row, seeds reproduce, and sampled
frequencies follow the filtered softmax."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvstate.engine.params import SamplingParams
from kvstate.engine.sampling import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    RequestGenerators,
    make_generator,
    process_logits,
    sample,
)
from kvstate.errors import KvstateError


def logits(rows=6, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=make_generator(seed)) * 3


def test_greedy_is_argmax_whatever_the_filters():
    x = logits(8, 1000)
    params = [SamplingParams(temperature=0, top_k=3, top_p=0.1, min_p=0.5, seed=i) for i in range(4)]
    params += [SamplingParams(temperature=1e-6), SamplingParams(temperature=0)] * 2  # below 1e-5: greedy too
    out = sample(x, params, generator=make_generator(1))
    assert out.token_ids == x.argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_masks_match_transformers_warpers_row_by_row():
    x = logits(5, 64)
    k = torch.tensor([1, 5, 0, 64, 80])  # 0 and >= vocab: off
    p = torch.tensor([0.05, 0.5, 0.9, 0.999, 1.0])
    m = torch.tensor([0.0, 0.01, 0.1, 0.5, 1.0])
    got_k, got_p, got_m = apply_top_k(x, k), apply_top_p(x, p), apply_min_p(x, m)
    for i in range(5):
        row = x[i : i + 1]
        want_k = TopKLogitsWarper(int(k[i]))(None, row) if 0 < k[i] < 64 else row
        assert torch.equal(got_k[i : i + 1], want_k)
        assert torch.equal(got_p[i : i + 1], TopPLogitsWarper(float(p[i]))(None, row))
        assert torch.equal(got_m[i : i + 1], MinPLogitsWarper(float(m[i]))(None, row))


@pytest.mark.parametrize("candidates", [4, 20])
def test_top_p_beyond_its_candidates_falls_back_to_the_full_sort(monkeypatch, candidates):
    import kvstate.engine.sampling as sampling

    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
    x = torch.cat([logits(4, 64, seed=3), logits(2, 64, seed=4) * 4])  # flat rows and peaked rows
    p = torch.tensor([0.05, 0.3, 0.7, 0.95, 0.9, 0.99])
    got = apply_top_p(x, p)
    for i in range(len(p)):
        assert torch.equal(got[i : i + 1], TopPLogitsWarper(float(p[i]))(None, x[i : i + 1])), i


def test_masks_match_a_direct_computation():
    x = logits(1, 12)[0]
    probs = x.softmax(-1)
    order = probs.argsort(descending=True).tolist()
    for k in (1, 3, 7):
        kept = set(torch.nonzero(apply_top_k(x[None], torch.tensor([k]))[0] > float("-inf")).flatten().tolist())
        assert kept == set(order[:k])
    for top_p in (0.2, 0.6, 0.95):
        mass, want = 0.0, set()
        for t in order:  # smallest prefix of the most likely tokens whose mass reaches top_p
            want.add(t)
            mass += float(probs[t])
            if mass >= top_p:
                break
        kept = set(torch.nonzero(apply_top_p(x[None], torch.tensor([top_p]))[0] > float("-inf")).flatten().tolist())
        assert kept == want
    for min_p in (0.05, 0.3):
        want = {t for t in range(12) if probs[t] >= min_p * probs.max()}
        kept = set(torch.nonzero(apply_min_p(x[None], torch.tensor([min_p]))[0] > float("-inf")).flatten().tolist())
        assert kept == want


def test_pipeline_is_vllms_order_of_transformers_warpers():
    x = logits(4, 40)
    params = [SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05),
              SamplingParams(temperature=1.3, top_p=0.5),
              SamplingParams(temperature=0.5, top_k=3),
              SamplingParams(temperature=2.0, min_p=0.2, top_p=0.9)]
    got = process_logits(x, params)
    for i, sp in enumerate(params):
        row = TemperatureLogitsWarper(sp.temperature)(None, x[i : i + 1])
        if sp.min_p > 0:
            row = MinPLogitsWarper(sp.min_p)(None, row)
        if sp.top_k > 0:
            row = TopKLogitsWarper(sp.top_k)(None, row)
        if sp.top_p < 1:
            row = TopPLogitsWarper(sp.top_p)(None, row)
        torch.testing.assert_close(got[i : i + 1], row, rtol=0, atol=0)


def test_samples_stay_inside_the_filtered_set_and_follow_its_softmax():
    vocab, n = 6, 40000
    base = torch.tensor([1.0, -3.0, 2.0, 0.3, 1.5, -0.5])  # unsorted: candidate ids must map back
    for sp in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=4),
               SamplingParams(temperature=1.5, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.2),
               SamplingParams(temperature=0.9, top_k=5, top_p=0.9, min_p=0.1)):  # top_k: on the candidates
        x = base.expand(n, vocab)
        out = sample(x, [sp] * n, generator=make_generator(123)).token_ids
        freq = torch.bincount(torch.tensor(out), minlength=vocab).double() / n
        want = process_logits(base[None], [sp]).softmax(-1)[0].double()
        assert freq[want == 0].sum() == 0, sp  # a filtered token is never drawn
        torch.testing.assert_close(freq, want, rtol=0, atol=0.012)  # ~5 standard errors at n = 40000


def test_seeded_rows_reproduce_whatever_the_batch_around_them():
    x = logits(3, 2000)
    seeded = SamplingParams(temperature=1.0, seed=42)
    free = SamplingParams(temperature=1.0)

    def draws(rows, params, steps=6):
        gens = RequestGenerators()  # the runner's: one generator per seeded request id, kept across steps
        ids = list(range(len(params)))
        return [sample(rows, params, gens.get(ids, params)).token_ids for _ in range(steps)]

    alone = [d[0] for d in draws(x[:1], [seeded])]
    with_others = [d[1] for d in draws(x[[1, 0, 2]], [free, seeded, free])]
    assert alone == with_others  # same row, same seed: same tokens at another position, other rows around
    again = [d[0] for d in draws(x[:1], [SamplingParams(temperature=1.0, seed=42)])]
    other = [d[0] for d in draws(x[:1], [SamplingParams(temperature=1.0, seed=43)])]
    assert again == alone and other != alone and len(set(alone)) > 1  # the generator advances per step


def test_logprobs_are_the_raw_distribution():
    x = logits(3, 30)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.8, logprobs=0),
              SamplingParams(temperature=0)]
    out = sample(x, params, generator=make_generator(5))
    lp = x.log_softmax(-1)
    for i in (0, 1):
        assert out.logprobs[i] == pytest.approx(float(lp[i, out.token_ids[i]]), abs=1e-6)
    want = lp[0].topk(3)
    assert [t for t, _ in out.top_logprobs[0]] == want.indices.tolist()
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(want.values.tolist(), abs=1e-6)
    assert out.top_logprobs[1] == [] and out.logprobs[2] is None and out.top_logprobs[2] is None


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be a number"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -2}, "top_k must be 0 or -1"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"min_p": 1.2}, r"min_p must be in \[0, 1\]"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"stop": [""]}, "stop must hold non-empty strings"),
    ({"stop": 3}, "stop must be a string or a list"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be >= 0"),
    ({"logprobs": -1}, "logprobs must be >= 0"),
    ({"ignore_eos": "yes"}, "ignore_eos must be True or False"),
    ({"seed": "1"}, "seed must be an integer"),
])
def test_params_validation_names_the_field(kwargs, message):
    with pytest.raises(KvstateError, match=message):
        SamplingParams(**kwargs)


def test_params_normalize_like_vllm():
    p = SamplingParams(stop="###", top_k=-1, stop_token_ids=(3, 4))
    assert p.stop == ["###"] and p.top_k == 0 and p.stop_token_ids == [3, 4] and not p.greedy
    assert SamplingParams(temperature=0).greedy and not SamplingParams().filters
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(2, 5), [SamplingParams()])
