"""The batched sampler: one row of logits per request, each with its own SamplingParams.

Per row, as vLLM does: penalties first (`kvstate.engine.penalties`, rows that ask for them);
then greedy rows (temperature < 1e-5) take the argmax; the others are divided by their
temperature, filtered by min_p, top_k, then top_p (each only where that row asks for it), and
sampled from the softmax of what is left by inverse CDF: one uniform number per row, found in
the row's cumulative probabilities. A row with a seed draws that number from its own
generator, so its tokens do not depend on the rows around it or on how its prompt was chunked.
Nothing sorts the whole vocabulary (a 250k-token sort per row is slow on CPU): when every
sampled row has a top_k, the whole filter-and-sample runs on the top-k candidates; otherwise
top_p looks at the `topk` 1024 most likely tokens, falling back to a full sort only for rows
whose candidates hold less than top_p of the mass. Logprobs, when asked for, are those of the
raw model distribution (vLLM's default "raw_logprobs"): the chosen token's plus the top n.

The seeded generators are per-request state: `RequestGenerators` (owned by the runner) keeps one
per request id from its first sampled token until the request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstate.engine.params import SamplingParams
from kvstate.engine.penalties import apply_penalties
from kvstate.profiling import timed


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # chosen token's logprob, for rows with params.logprobs set
    top_logprobs: list[list[tuple[int, float]] | None]  # the params.logprobs most likely (token, logprob)
    prompt_logprobs: list = field(default_factory=list)  # (seq, first position, entries), engine.prompt_logprobs
    hidden: object = None  # the step's hidden states for a drafter (kvstate.engine.runner.StepHidden), if kept


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


class RequestGenerators:
    """The seeded requests' generators, keyed by request id: made from the seed on first use,
    advanced by every token sampled, dropped when the request finishes."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = device
        self._by_id: dict[object, torch.Generator] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, request_ids: list, params: list[SamplingParams]) -> list[torch.Generator | None]:
        """One entry per row: the request's generator, or None for an unseeded request."""
        out = []
        for rid, p in zip(request_ids, params):
            if p.seed is None:
                out.append(None)
                continue
            if rid not in self._by_id:
                self._by_id[rid] = make_generator(p.seed, self.device)
            out.append(self._by_id[rid])
        return out

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self._by_id.pop(rid, None)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [B, V] / temperature [B] (rows with temperature 0 must not reach here)."""
    return logits / temperature.unsqueeze(1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p [B] times the row's largest (0 = off)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the k [B] largest logits of each row (ties with the k-th kept; k <= 0 or >= V = off)."""
    vocab = logits.shape[-1]
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k).long()
    top = logits.topk(int(k.max()), dim=-1).values  # [B, kmax], descending
    kth = top.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


TOP_P_CANDIDATES = 1024  # most likely tokens top_p looks at before falling back to a full sort


def _top_p_drop_sorted(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Full-sort top_p mask (True = drop) for probs [R, V]: drop where the mass at or below a
    token, in ascending order, is <= 1 - top_p (transformers' TopPLogitsWarper rule)."""
    sorted_probs, order = probs.sort(dim=-1)  # ascending
    drop = sorted_probs.cumsum(dim=-1) <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always stays
    return drop.scatter(1, order, drop)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p [B] (1 = off): a token
    stays while the mass of the tokens more likely than it is below top_p."""
    probs = logits.softmax(dim=-1)
    k = min(probs.shape[-1], TOP_P_CANDIDATES)
    vals, idx = probs.topk(k, dim=-1)  # [B, k], descending
    mass = vals.cumsum(dim=-1)
    keep = (mass - vals) < top_p.unsqueeze(1)
    drop = torch.ones_like(probs, dtype=torch.bool).scatter_(1, idx, ~keep)
    short = (mass[:, -1] < top_p) & (top_p < 1)  # the kept set may reach past the candidates
    if k < probs.shape[-1] and bool(short.any()):
        drop[short] = _top_p_drop_sorted(probs[short], top_p[short])
    drop &= (top_p < 1).unsqueeze(1)
    return logits.masked_fill(drop, float("-inf"))


def process_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """fp32 logits [B, V] after temperature, min_p, top_k, top_p; the distribution rows sample from.
    Rows with greedy params pass through untouched."""
    logits = logits.float()
    greedy = [p.greedy for p in params]
    if all(greedy):
        return logits
    temp = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=logits.device)
    logits = apply_temperature(logits, temp)
    active = [p for p, g in zip(params, greedy) if not g]
    if any(p.min_p > 0 for p in active):
        logits = apply_min_p(logits, torch.tensor([0.0 if g else p.min_p for p, g in zip(params, greedy)],
                                                  device=logits.device))
    if any(p.top_k > 0 for p in active):
        logits = apply_top_k(logits, torch.tensor([0 if g else p.top_k for p, g in zip(params, greedy)],
                                                  device=logits.device))
    if any(p.top_p < 1 for p in active):
        logits = apply_top_p(logits, torch.tensor([1.0 if g else p.top_p for p, g in zip(params, greedy)],
                                                  device=logits.device))
    return logits


def _uniforms(rows: int, generators, default: torch.Generator | None, device) -> torch.Tensor:
    """u [rows, 1] in [0, 1); row i from generators[i] when it has one, else from `default`."""
    u = torch.empty(rows, 1, device=device)
    if any(g is None for g in generators):
        u.uniform_(generator=default)  # one call for the unseeded rows (seeded rows redrawn below)
    for i, g in enumerate(generators):
        if g is not None:
            u[i].uniform_(generator=g)
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token i of each row of probs [R, V] with probability p_i, from u [R, 1] in [0, 1)."""
    cdf = probs.cumsum(dim=-1)  # non-decreasing in fp32 too (the summands are >= 0)
    target = (1 - u) * cdf[:, -1:]  # in (0, total]: a token of probability 0 is never found
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[-1] - 1)


@torch.inference_mode()
@timed("sampling")
def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list | None = None, *,
           generator: torch.Generator | None = None, history: tuple[list, list] | None = None) -> SampleOutput:
    """One token per row of logits [B, V]. `generators[i]`: row i's own generator (or None);
    `generator`: the one shared by the other rows (None = torch's global generator);
    `history`: (prompt ids, output ids) per row, needed when a row has penalties."""
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits must be [len(params), vocab], got {tuple(logits.shape)} for {len(params)} params")
    generators = [None] * len(params) if generators is None else list(generators)
    if len(generators) != len(params):
        raise ValueError(f"generators must have one entry per row, got {len(generators)} for {len(params)}")
    raw = logits.float()
    scores = raw  # what greedy and sampling see: raw logits after the penalties
    if any(p.penalties for p in params):
        if history is None:
            raise ValueError("penalties need the prompt and output ids of every row (history)")
        scores = apply_penalties(raw, params, *history)
    tokens = scores.argmax(dim=-1)  # [B]; first maximum on ties
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        sub = [params[i] for i in rows]
        x, cand = scores[rows], None
        top_k = [p.top_k for p in sub]
        if min(top_k) > 0 and max(top_k) < x.shape[-1]:
            # every row keeps only tokens among its top k: filter and sample there, exactly the
            # same distribution (min_p and top_p only compare probabilities within that set)
            x, cand = x.topk(max(top_k), dim=-1)  # [R, K]
            # back in vocabulary order: the inverse CDF then picks the same token for the same u
            # as the full-vocabulary path, so a seeded row does not depend on its batch
            cand, order = cand.sort(dim=-1)
            x = x.gather(1, order)
        probs = process_logits(x, sub).softmax(dim=-1)  # [R, V] or [R, K]
        u = _uniforms(len(rows), [generators[i] for i in rows], generator, probs.device)
        picked = _inverse_cdf(probs, u)
        tokens[rows] = picked if cand is None else cand.gather(1, picked.unsqueeze(1)).squeeze(1)
    token_ids = tokens.tolist()
    logprobs: list[float | None] = [None] * len(params)
    tops: list[list[tuple[int, float]] | None] = [None] * len(params)
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    if asked:
        lp = raw[asked].log_softmax(dim=-1)  # [A, V]
        chosen = lp.gather(1, tokens[asked].unsqueeze(1)).squeeze(1).tolist()
        n = min(max(params[i].logprobs for i in asked), lp.shape[-1])
        top_v, top_i = lp.topk(n, dim=-1)
        for r, i in enumerate(asked):
            logprobs[i] = chosen[r]
            k = params[i].logprobs
            tops[i] = list(zip(top_i[r, :k].tolist(), top_v[r, :k].tolist()))
    return SampleOutput(token_ids, logprobs, tops)
