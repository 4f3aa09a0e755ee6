"""The one generic hybrid decoder: embeddings, a stack of blocks, final norm, LM head.

A block is `x += mixer(norm(x))` then `x += ffn(norm(x))`, with either part optional
(Nemotron-H blocks hold a mixer or an FFN, not both). Mixers are any token mixer of
`kvstate.layers` with the signature `mixer(x [T, hidden], batch, cache) -> [T, hidden]`, or
`ParallelMixers`, several of them side by side on one input (Falcon-H1: attention and Mamba-2,
each reading its own keys of the layer's cache); FFNs are position-wise `ffn(x) -> x`. A family
may scale the embeddings and the logits (Falcon-H1's multipliers); the logits' scale is applied
to the final norm's output, so every consumer of the normed hidden states sees it. The forward
takes the packed batch metadata and the per-layer caches explicitly and returns logits only for
`batch.logits_indices`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kvstate.kernels import Embedding
from kvstate.models import decode_blocks
from kvstate.profiling import timed


class ParallelMixers(nn.ModuleDict):
    """Mixers side by side, by kind: sum over kinds of out_scale * mixer(in_scale * x), one cache."""

    def __init__(self, mixers: dict[str, nn.Module], scales: dict[str, tuple[float, float]]):
        super().__init__(mixers)
        self.scales = {kind: tuple(scales.get(kind, (1.0, 1.0))) for kind in mixers}

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        out = None
        for kind, mixer in self.items():
            s_in, s_out = self.scales[kind]
            y = mixer(x if s_in == 1 else x * s_in, batch, cache)  # [T, hidden]
            y = y if s_out == 1 else y * s_out
            out = y if out is None else out + y
        return out


class Block(nn.Module):
    def __init__(self, mixer: nn.Module | None, ffn: nn.Module | None, norm: Callable[[], nn.Module]):
        super().__init__()
        self.input_norm = norm() if mixer is not None else None
        self.mixer = mixer
        self.ffn_norm = norm() if ffn is not None else None
        self.ffn = ffn

    def mixer_modules(self) -> list[nn.Module]:
        """The block's mixers in the plan's order (LayerSpec.mixers)."""
        if self.mixer is None:
            return []
        return list(self.mixer.values()) if isinstance(self.mixer, ParallelMixers) else [self.mixer]

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        x, delta = self.forward_pending(x, None, batch, cache)
        return x if delta is None else x + delta

    def forward_pending(self, x: torch.Tensor, delta: torch.Tensor | None, batch, cache):
        """The block on x + delta with its own last residual add left pending: (x', d), x' + d being
        forward(x + delta). Each pending add is done by the next RMSNorm's kernel (`add_forward`):
        a decode step then runs no separate add per block (after a weight-streaming call the caches
        are cold, and such a torch op cost ~40 us on the 0.5b model's machine, 24 per step)."""
        if self.mixer is not None:
            x, normed = _add_norm(self.input_norm, x, delta)
            delta = self.mixer(normed, batch, cache)
        if self.ffn is not None:
            x, normed = _add_norm(self.ffn_norm, x, delta)
            delta = self.ffn(normed)
        return x, delta


def _add_norm(norm: nn.Module, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, norm(x + delta)); the add fused into the norm's kernel when it has one (RMSNorm)."""
    if delta is None:
        return x, norm(x)
    add_norm = getattr(norm, "add_forward", None)
    if add_norm is not None:
        return add_norm(x, delta)
    x = x + delta
    return x, norm(x)


class HybridDecoder(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, blocks: list[Block], norm: Callable[[], nn.Module], *,
                 tie_word_embeddings: bool = False, plan=None, embedding_scale: float = 1.0,
                 logits_scale: float = 1.0):
        super().__init__()
        self.embed_tokens = Embedding(vocab_size, hidden_size)  # may hold a GGUF's blocks (kernels.Embedding)
        self.layers = nn.ModuleList(blocks)
        self.norm = norm()
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.plan = plan  # the ModelPlan it was built from: its cache spec sizes the pools
        self.mtp = None  # the multi-token-prediction head (kvstate.models.mtp), where the checkpoint has one
        self.embedding_scale, self.logits_scale = embedding_scale, logits_scale

    @property
    def layer_string(self) -> str:
        """One letter per layer's mixer kind, e.g. "GGGA" * 6."""
        return self.plan.layer_string if self.plan is not None else ""

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @timed("model")
    def forward(self, input_ids: torch.Tensor, batch, caches: list, *, hidden: bool = False):
        """input_ids [T] packed -> logits [M, vocab] (fp32) for the rows batch.logits_indices only
        (the last token of each sampled entry): mid-prefill rows never reach the LM head.
        `hidden`: (logits, every token's last hidden state after the final norm [T, hidden]), what
        the MTP head drafts from; the logits are the same rows, normed alone, as without it."""
        x = self.embed_tokens(input_ids).to(self.norm.weight.dtype)  # a bf16-stored table widens exactly
        if self.embedding_scale != 1:
            x = x * self.embedding_scale
        delta = None  # each block's last residual add, left to the next block's first norm
        compiled = decode_blocks.for_step(self, batch)  # a decode step's blocks as one call each, or None
        for i, (block, cache) in enumerate(zip(self.layers, caches)):
            if compiled is not None and compiled[i] is not None:
                x, delta = decode_blocks.run(compiled[i], x, delta, batch, cache)
            else:
                x, delta = block.forward_pending(x, delta, batch, cache)
        if delta is not None:
            x = x + delta
        if not hidden:
            return self.lm_head(self._final_norm(x.index_select(0, batch.logits_indices))).float()  # [M, vocab]
        normed = self._final_norm(x)  # [T, hidden]: the norm is per row, so the logits rows are as above
        rows = normed if batch.logits_indices.shape[0] == x.shape[0] else normed.index_select(0, batch.logits_indices)
        return self.lm_head(rows).float(), normed

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.norm(x)
        return normed if self.logits_scale == 1 else normed * self.logits_scale  # the LM head is linear
