"""Perplexity, and KL divergence and top-1 agreement against a base, token by token.

Each window runs as one prefill (its own caches, the model's normed hidden states of every
position); the LM head and log-softmax then run a few positions at a time (the engine's
`prompt_logprobs.chunk_rows`), so a long context never holds a [T, vocab] fp32 tensor. With a
base model in the same process both run window by window, chunk by chunk, and the KL is exact:
sum_v p_base(v) (log p_base(v) - log p(v)). A saved base file keeps, per scored token, the base's
`BASE_TOP_K` most likely tokens and their logprobs and its logprob of the text's token: from it
the KL is taken over those tokens plus one bucket for the rest of the vocabulary (a lower bound
of the exact KL, which it meets when the base's mass sits in its top K), the agreement exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstate.engine.prompt_logprobs import chunk_rows
from kvstate.errors import KvstateError
from kvstate.eval.windows import Window
from kvstate.models.batch import Batch
from kvstate.models.generate import contiguous_caches

BASE_TOP_K = 64


@dataclass
class Scores:
    """Per scored token: the text's token's logprob, and against a base its KL and top-1 agreement."""

    logprobs: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    agree: list[bool] = field(default_factory=list)

    def summary(self, base: "Scores | None" = None) -> dict:
        n = len(self.logprobs)
        nll = -math.fsum(self.logprobs) / n
        out = {"tokens": n, "ppl": math.exp(nll), "nll": nll}
        if base is not None:
            out["ln_ppl_ratio"] = nll - (-math.fsum(base.logprobs) / len(base.logprobs))
        if self.kl:
            kl = sorted(self.kl)
            out.update(kl_mean=math.fsum(kl) / len(kl), kl_median=kl[len(kl) // 2],
                       kl_p99=kl[min(len(kl) - 1, int(0.99 * len(kl)))], kl_max=kl[-1],
                       top1_agree=sum(self.agree) / len(self.agree))
        return out


@torch.inference_mode()
def window_chunks(model, ids: list[int], window: Window):
    """(first scored token, log-softmax [C, vocab] fp32 of the rows scoring it and the next C - 1)."""
    fed = ids[window.begin:window.end]
    caches = contiguous_caches(model, 1, len(fed))
    batch = Batch.build([len(fed)], [0], [0], [[0]], len(fed), sample_rows=[], device=model.device)
    _, normed = model(torch.tensor(fed, dtype=torch.int64, device=model.device), batch, caches, hidden=True)
    step = chunk_rows(model.lm_head.weight.shape[0])
    for t in range(window.first, window.end, step):  # token t is scored by row t - 1 - begin
        stop = min(t + step, window.end)
        rows = normed[t - 1 - window.begin: stop - 1 - window.begin]
        yield t, model.lm_head(rows).float().log_softmax(dim=-1)


def _own(lp: torch.Tensor, ids: list[int], t: int) -> torch.Tensor:
    target = torch.tensor(ids[t:t + lp.shape[0]], dtype=torch.int64, device=lp.device)
    return lp.gather(1, target.unsqueeze(1)).squeeze(1)  # [C]


def score(model, ids: list[int], windows: list[Window], *, base_model=None, base_file: "BaseFile | None" = None,
          keep: "BaseFile | None" = None, progress=None) -> tuple[Scores, Scores | None]:
    """This model's scores over the windows (and the base model's, when one runs beside it).
    `keep`: a BaseFile to fill with this model's top tokens (to save as a base); `progress()` per window."""
    mine, theirs = Scores(), Scores() if base_model is not None else None
    at = 0  # scored tokens so far (the base file's row)
    for w in windows:
        pairs = window_chunks(model, ids, w)
        other = window_chunks(base_model, ids, w) if base_model is not None else None
        for t, lp in pairs:
            own = _own(lp, ids, t)
            mine.logprobs += own.double().tolist()
            if other is not None:
                _, blp = next(other)
                theirs.logprobs += _own(blp, ids, t).double().tolist()
                mine.kl += (blp.exp() * (blp - lp)).sum(dim=-1).double().clamp_(min=0).tolist()
                mine.agree += (blp.argmax(dim=-1) == lp.argmax(dim=-1)).tolist()
            elif base_file is not None:
                kl, agree = base_file.compare(at, lp)
                mine.kl += kl
                mine.agree += agree
            if keep is not None:
                keep.add(lp, own)
            at += lp.shape[0]
        if progress is not None:
            progress()
    return mine, theirs


class BaseFile:
    """A base model's top tokens per scored token (safetensors + JSON metadata), to compare against later."""

    def __init__(self, meta: dict, top_ids=None, top_logprobs=None, own=None):
        self.meta = meta
        self.top_ids, self.top_logprobs, self.own = top_ids or [], top_logprobs or [], own or []

    def add(self, lp: torch.Tensor, own: torch.Tensor) -> None:
        v, i = lp.topk(min(BASE_TOP_K, lp.shape[-1]), dim=-1)
        self.top_ids.append(i.to(torch.int32))
        self.top_logprobs.append(v)
        self.own.append(own)

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        tensors = {"top_ids": torch.cat(self.top_ids), "top_logprobs": torch.cat(self.top_logprobs),
                   "own_logprobs": torch.cat(self.own)}
        save_file(tensors, str(path), metadata={"kvstate_eval_base": json.dumps(self.meta)})

    @classmethod
    def load(cls, path: Path) -> "BaseFile":
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta = json.loads((f.metadata() or {})["kvstate_eval_base"])
                tensors = {k: f.get_tensor(k) for k in ("top_ids", "top_logprobs", "own_logprobs")}
        except (OSError, KeyError, ValueError, Exception) as exc:  # safetensors raises its own error types
            raise KvstateError(f"{path}: not a base file of `kvstate eval perplexity --save-base` "
                               f"({str(exc).splitlines()[0][:100] if str(exc) else type(exc).__name__})") from None
        return cls(meta, [tensors["top_ids"]], [tensors["top_logprobs"]], [tensors["own_logprobs"]])

    def check(self, meta: dict) -> None:
        """The base must have scored the same tokens over the same windows."""
        for key in ("tokens_sha256", "context", "stride"):
            if self.meta.get(key) != meta.get(key):
                raise KvstateError(f"the base file was made with {key} {self.meta.get(key)}, this run has "
                                   f"{meta.get(key)}: give the same --file, --context and --stride")

    def scores(self) -> Scores:
        return Scores(logprobs=self.own[0].double().tolist())

    def compare(self, at: int, lp: torch.Tensor) -> tuple[list[float], list[bool]]:
        """KL over the base's top K plus the rest, and top-1 agreement, for rows at, at + 1, ... of lp [C, V]."""
        ids = self.top_ids[0][at:at + lp.shape[0]].long()
        blp = self.top_logprobs[0][at:at + lp.shape[0]]  # [C, K]
        qlp = lp.gather(1, ids)
        p = blp.exp()
        rest_p = (1 - p.sum(dim=-1)).clamp(min=0)
        rest_q = (1 - qlp.exp().sum(dim=-1)).clamp(min=1e-12)
        kl = (p * (blp - qlp)).sum(dim=-1)
        kl = kl + torch.where(rest_p > 0, rest_p * (rest_p.clamp(min=1e-12).log() - rest_q.log()), 0.0)
        agree = ids[:, 0] == lp.argmax(dim=-1)
        return kl.double().clamp_(min=0).tolist(), agree.tolist()
