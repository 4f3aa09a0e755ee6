"""What a fixed-size state holds, without training: write N key-value pairs into one head's
[key_dim, value_dim] state with linear attention (plain, or gated by a decay) or the delta rule,
then read every key back.

The first spec document's worked example, at any size: with 2-D keys, linear attention reads two
pairs back exactly and all three wrong once a third is written; the delta rule (beta = 1) reads the
newest exactly and disturbs the older ones. "Capacity is still d_k; the delta rule changes who gives
way: linear attention blurs every entry, the delta rule keeps the newest write exact", while a gate
"can only decay everything together, it cannot change one entry precisely". This module measures
that with kvstate's own chunk ops on random unit keys and values: the accuracy of every read (is
it nearer its own value than any other written value?), split by write order.

Write then read runs as one sequence of 2N positions through the op: N writes, then the same N
keys as queries whose own writes are empty (value 0 for linear attention, beta 0 for the delta
rule) and which do not decay the state, so each read sees the state after the last write.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from kvstate.ops import chunk_delta_rule, chunk_gated_linear_attention, chunk_linear_attention


@dataclass(frozen=True)
class CapacityRow:
    beta: float | None  # the delta rule's write strength (None: linear attention)
    decay: float | None  # gated linear attention: the state is multiplied by it at every write
    key_dim: int  # = value dim
    pairs: int
    accuracy: float  # reads nearer their own value than any other value written
    newest: float  # accuracy over the newest quarter of the writes
    oldest: float  # ... and over the oldest quarter
    cosine: float  # mean cosine of a read with its value (scale-free: the models normalise what they read)
    by_rank: list[float]  # accuracy per write, oldest first

    @property
    def mixer(self) -> str:
        if self.beta is not None:
            return "delta rule"
        return "linear attention" if self.decay is None else "gated linear attention"

    def as_dict(self) -> dict:
        return {"mixer": self.mixer, **asdict(self)}


def mixer_label(row: CapacityRow) -> str:
    """'linear attention', 'gated linear attention, decay 0.9', 'delta rule, beta 1'."""
    if row.beta is not None:
        return f"{row.mixer}, beta {row.beta:g}"
    return row.mixer if row.decay is None else f"{row.mixer}, decay {row.decay:g}"


def write_then_read(keys: torch.Tensor, values: torch.Tensor, beta: float | None = None,
                    decay: float | None = None) -> torch.Tensor:
    """keys [B, N, K], values [B, N, V] -> reads [B, N, V]: the state after the N writes read at each
    key. beta None: linear attention, S = decay S + v k^T (no decay when None); else the delta rule
    S += beta (v - S k) k^T."""
    b, n, _ = keys.shape
    q = torch.cat([keys, keys], 1).unsqueeze(2)  # [B, 2N, 1, K]: writes, then reads of the same keys
    v = torch.cat([values, torch.zeros_like(values)], 1).unsqueeze(2)  # [B, 2N, 1, V]
    if beta is not None and decay is not None:
        raise ValueError("write_then_read: a decay gates linear attention only")
    if decay is not None:
        log_decay = torch.cat([keys.new_full((b, n, 1), math.log(decay)), keys.new_zeros(b, n, 1)], 1)  # [B, 2N, 1]
        o, _ = chunk_gated_linear_attention(q, q, v, log_decay, scale=1.0)
    elif beta is None:
        o, _ = chunk_linear_attention(q, q, v, scale=1.0)
    else:
        strength = torch.cat([keys.new_full((b, n, 1), beta), keys.new_zeros(b, n, 1)], 1)  # [B, 2N, 1]
        o, _ = chunk_delta_rule(q, q, v, strength, scale=1.0)
    return o[:, n:, 0]


def _score(reads: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per-read hits [B, N] (own value the nearest by dot product among the N written) and the mean cosine."""
    nearest = torch.einsum("bnv,bmv->bnm", reads, values).argmax(-1)  # [B, N]
    hits = (nearest == torch.arange(values.shape[1])).float()
    return hits, F.cosine_similarity(reads, values, dim=-1).mean().item()


def random_pairs(trials: int, pairs: int, key_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit keys and values, Gaussian directions: [trials, pairs, key_dim] each."""
    g = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(trials, pairs, key_dim, generator=g), dim=-1)
    values = F.normalize(torch.randn(trials, pairs, key_dim, generator=g), dim=-1)
    return keys, values


def capacity_rows(key_dims: list[int], pairs: list[int], betas: list[float], *, decays: list[float] = (),
                  trials: int = 256, seed: int = 0) -> list[CapacityRow]:
    """One row per key dim x pair count x mixer (linear attention, gated linear attention at each
    decay, the delta rule at each beta); every mixer reads the same random pairs."""
    mixers = [(None, None), *((None, a) for a in decays), *((b, None) for b in betas)]  # (beta, decay)
    rows = []
    for d in key_dims:
        for n in pairs:
            keys, values = random_pairs(trials, n, d, seed)
            quarter = max(1, n // 4)
            for beta, decay in mixers:
                hits, cosine = _score(write_then_read(keys, values, beta, decay), values)
                rank = hits.mean(0)  # [N] oldest first
                rows.append(CapacityRow(beta, decay, d, n, hits.mean().item(), rank[-quarter:].mean().item(),
                                        rank[:quarter].mean().item(), cosine, [round(x, 4) for x in rank.tolist()]))
    return rows
