"""Prompt logprobs: each prompt token's log-probability given the tokens before it (vLLM's semantics).

Position r's hidden state (after the final norm) scores prompt token r + 1. The LM head and the
log-softmax run over a few positions at a time, so a long prompt never holds a [T, vocab] fp32
tensor: `CHUNK_BYTES` of logits at most (about 100 positions of a 150k vocabulary). Per position
the result is {token: Logprob}: the prompt's own token first, with its rank (1 + the tokens
strictly more likely), then the k most likely tokens, ranks 1..k (a token in both is listed once).
"""

from __future__ import annotations

import torch

from kvstate.engine.outputs import Logprob

CHUNK_BYTES = 64 << 20  # fp32 logits held at once


def chunk_rows(vocab_size: int) -> int:
    """Positions per LM-head call within CHUNK_BYTES of fp32 logits."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


@torch.inference_mode()
def score(lm_head, normed: torch.Tensor, targets: list[int], k: int) -> list[dict[int, Logprob]]:
    """{token: Logprob} per row of normed [R, hidden]: targets[r] (the token that follows) and the k most likely."""
    out: list[dict[int, Logprob]] = []
    step = chunk_rows(lm_head.weight.shape[0])
    target = torch.tensor(targets, dtype=torch.int64, device=normed.device)
    for a in range(0, normed.shape[0], step):
        lp = lm_head(normed[a:a + step]).float().log_softmax(dim=-1)  # [C, V]
        t = target[a:a + step].unsqueeze(1)  # [C, 1]
        own = lp.gather(1, t)  # [C, 1]
        ranks = (lp > own).sum(dim=-1) + 1  # [C]
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], t[:, :0])  # [C, k]
        for tok, v, rank, tv, ti in zip(t[:, 0].tolist(), own[:, 0].tolist(), ranks.tolist(), top_v.tolist(),
                                        top_i.tolist()):
            entry = {tok: Logprob(v, rank)}
            for j, (lpj, tj) in enumerate(zip(tv, ti)):
                if tj not in entry:
                    entry[tj] = Logprob(lpj, j + 1)
            out.append(entry)
    return out


def step_prompt_logprobs(lm_head, hidden: torch.Tensor, step) -> list[tuple]:
    """(sequence, first position, entries) for each entry of `step` that scores prompt tokens;
    `hidden` [T, hidden] is the step's normed last hidden states, the entries' rows packed in order."""
    out = []
    offsets = [0]
    for n in step.num_tokens:
        offsets.append(offsets[-1] + n)
    for i, rows in step.prompt_rows():
        seq, start = step.seqs[i], step.context_lens[i]
        base = offsets[i] - start  # row of position p: base + p
        normed = hidden[base + rows.start: base + rows.stop]
        targets = seq.prompt_token_ids[rows.start + 1: rows.stop + 1]
        out.append((seq, rows.start + 1, score(lm_head, normed, targets, seq.params.prompt_logprobs)))
    return out
