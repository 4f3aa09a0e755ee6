"""The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3-Next checkpoints (`mtp.*`), run as a drafter.

One step at position p takes the target's last-layer hidden state h_p (after the final norm: the
one the LM head reads) and the embedding of the token at p + 1, and predicts the token at p + 2:

    x = fc([pre_fc_norm_embedding(embed(t_{p+1})), pre_fc_norm_hidden(h_p)])    # [T, 2H] -> [T, H]
    y = norm(block(x))                       # one full-attention decoder block, rotary at position p
    logits = lm_head(y)                      # the target's embedding and LM head, shared

Its attention keeps KV at the target's positions, in the target's KV blocks (the cache spec's
entry after the decoder's). Step k > 1 chains on its own output: y takes h's place (docs/mtp.md).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kvstate.models import decode_blocks
from kvstate.models.decoder import Block


class MtpHead(nn.Module):
    def __init__(self, hidden_size: int, block: Block, norm: Callable[[], nn.Module]):
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = norm()
        self.pre_fc_norm_hidden = norm()
        self.layers = nn.ModuleList([block])
        self.norm = norm()

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch, cache, embed: nn.Module,
                lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] (the token after each position), hidden [T, H] (the target's normed last hidden
        state there, or this head's own output when chaining) -> (logits [M, V] fp32 for
        batch.logits_indices, this head's output y [T, H])."""
        e = self.pre_fc_norm_embedding(embed(input_ids).to(hidden.dtype))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))  # [T, 2H] -> [T, H]
        compiled = decode_blocks.for_step(self, batch)  # a decode step's block as one call, like the target's
        if compiled is not None and compiled[0] is not None:
            x, delta = decode_blocks.run(compiled[0], x, None, batch, cache)
            y = self.norm.add_forward(x, delta)[1]  # [T, H]
        else:
            y = self.norm(self.layers[0](x, batch, cache))
        rows = y if batch.decode_only else y.index_select(0, batch.logits_indices)  # decode: every row, in order
        return lm_head(rows).float(), y

    def draft(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch, cache, embed: nn.Module,
              lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """As `forward`, but (greedy drafts [M] int64, y [T, H]): a decode-only step's rows run as one
        compiled call where the kernels serve it (decode_blocks.head_for_step), `forward` otherwise."""
        compiled = decode_blocks.head_for_step(self, batch, embed, lm_head)
        if compiled is not None:
            tables = batch.block_tables if batch.token_tables is None else batch.token_tables
            tokens, y, _ = decode_blocks.run_head(compiled, input_ids, hidden, cache, batch.positions, tables,
                                                  batch.kv_indices, sum(batch.kv_lens))
            return tokens, y
        logits, y = self(input_ids, hidden, batch, cache, embed, lm_head)
        return logits.argmax(dim=-1), y
