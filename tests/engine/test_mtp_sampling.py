"""Sampling with the MTP drafter keeps the target's distribution (kvstate.engine.speculative.mtp).

The shipped kvstate-phonebook-hybrid (a tiny model with a trained head) continues a copy chat with
temperature 4 and top-k 3 (spread enough that drafts are often rejected), three tokens per request,
many seeded requests: the second token comes out of a verify step with the head's draft (accepted
or rejected), the third from its bonus row or a plain step. The joint counts of the three tokens
must follow the target's own probabilities, computed from its logits over every prefix (chi-square
at p = 0.001); the same counts against the distribution of a slightly different temperature fail,
so the test can fail.
"""

import torch

from kvstate import LLM, SamplingParams
from kvstate.bench.speculative import copy_prompt
from kvstate.engine.sampling import process_logits
from kvstate.models.generate import forward_logits

TOP_K, N = 3, 3000
PARAMS = dict(temperature=4.0, top_k=TOP_K, max_tokens=3, ignore_eos=True)


def critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability 0.001 (Wilson-Hilferty; z of p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def chi2(counts: dict, probs: dict) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the cells expecting >= 5 draws, the rest pooled in one."""
    big = [c for c in probs if probs[c] * N >= 5]
    observed = [counts.get(c, 0) for c in big] + [N - sum(counts.get(c, 0) for c in big)]
    expected = [probs[c] * N for c in big] + [N * (1 - sum(probs[c] for c in big))]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    return stat, len(expected) - 1


def target_probs(llm, prompt: list[int], **change) -> dict[tuple, float]:
    """P(t1, t2, t3) under plain sampling: each step's top-k distribution from the target's logits."""
    params = SamplingParams(**{**PARAMS, **change})

    def dist(prefixes):
        logits = forward_logits(llm.model, [prompt + list(p) for p in prefixes])
        return [process_logits(x[-1:], [params]).softmax(-1)[0] for x in logits]

    probs = {(): 1.0}
    for _ in range(3):
        prefixes = list(probs)
        nxt = {}
        for p, d in zip(prefixes, dist(prefixes)):
            for t in torch.nonzero(d).flatten().tolist():
                nxt[p + (t,)] = probs[p] * float(d[t])
        probs = nxt
    return probs


@torch.inference_mode()
def test_sampled_tokens_with_mtp_drafts_follow_the_target_distribution():
    llm = LLM("kvstate-phonebook-hybrid", max_num_seqs=64, cache_memory="64MiB",
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    prompt = copy_prompt(llm, 0, 8, None)
    probs = target_probs(llm, prompt)
    assert abs(sum(probs.values()) - 1) < 1e-4 and len(probs) == TOP_K**3
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, [SamplingParams(**PARAMS, seed=i) for i in range(N)])
    counts: dict[tuple, int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    stats = llm.engine.proposer.stats()
    # the verify steps took both paths many times: drafts accepted and rejected
    assert stats["spec_num_draft_tokens"] >= N and 0.2 < stats["spec_acceptance_rate"] < 0.95, stats
    stat, df = chi2(counts, probs)
    assert stat < critical(df), (stat, df)
    wrong, wrong_df = chi2(counts, target_probs(llm, prompt, temperature=3.0))
    assert wrong > critical(wrong_df), (wrong, wrong_df)
