"""The MTP head unrolled over `depth` chained drafts, on padded dense sequences, for training.

At inference (docs/mtp.md) draft 1 at position p reads the target's h_p and the token t_{p+1};
draft d > 1 sits at position p + d - 1 and reads the head's own output y of draft d - 1 and the
token drafted before it. Its attention sees the head's KV written from the target's states at
positions 0 .. p and the KV the chain itself wrote at p + 1 .. p + d - 1. This module computes
every chain of a batch at once, with that attention pattern, so the head can be trained on the
drafts it will make: draft d's token input is the true t_{p+d} (a draft d only counts when the
drafts before it were accepted, i.e. right), its hidden input the chain's own y.

Depth 1 is the head's ordinary forward (a test holds its logits to `model.mtp`'s).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _heads(m, x: torch.Tensor, positions: torch.Tensor):
    """q [N, H, D] (rotated), k, v [N, Hkv, D] (k rotated), gate [N, H, D] or None for rows x [N, C]
    at `positions` [N]."""
    n = x.shape[0]
    q, k, v = m.q_proj(x), m.k_proj(x), m.v_proj(x)
    gate = None
    if m.output_gate:
        q, gate = q.view(n, m.num_heads, 2 * m.head_dim).chunk(2, dim=-1)
    q = q.reshape(n, m.num_heads, m.head_dim)
    k, v = k.view(n, m.num_kv_heads, m.head_dim), v.view(n, m.num_kv_heads, m.head_dim)
    if m.q_norm is not None:
        q, k = m.q_norm(q), m.k_norm(k)
    if m.rotary is not None:
        q, k = m.rotary(q, k, positions)
    return q, k, v, gate


def unrolled_logits(model, hidden: torch.Tensor, ids: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """hidden [B, T, H] (the target's normed last hidden states, padded), ids [B, T] (tokens, padded)
    -> [logits [B, T, V] of draft d for d = 1 .. depth]: row p of draft d predicts t_{p+d+1}.
    Rows whose inputs run past the sequence read padding; their targets must be masked."""
    head, block = model.mtp, model.mtp.layers[0]
    m = block.mixer
    b, t, hs = hidden.shape
    pos = torch.arange(t, device=hidden.device)
    group = m.num_heads // m.num_kv_heads
    real_mask = pos[None, :] <= pos[:, None]  # [T (query p), T (key j)]: keys of the target's states, j <= p
    chain_k, chain_v = [], []  # per chained depth: [B, T, Hkv, D] (row p: the key chain p wrote at p + d - 1)
    k1 = v1 = None
    h, out = hidden, []
    for d in range(1, depth + 1):
        tok = F.pad(ids[:, d:], (0, d))  # [B, T]: t_{p+d}, 0 past the end
        e = head.pre_fc_norm_embedding(model.embed_tokens(tok).to(h.dtype))
        x = head.fc(torch.cat([e, head.pre_fc_norm_hidden(h)], dim=-1))  # [B, T, 2H] -> [B, T, H]
        normed = block.input_norm(x)
        at = (pos + d - 1).repeat(b)  # [B * T] positions of the rows
        q, k, v, gate = _heads(m, normed.reshape(b * t, hs), at)
        q = q.view(b, t, m.num_heads, m.head_dim)
        k, v = k.view(b, t, m.num_kv_heads, m.head_dim), v.view(b, t, m.num_kv_heads, m.head_dim)
        if d == 1:
            k1, v1 = k, v
        else:
            chain_k.append(k)
            chain_v.append(v)
        kr = k1.repeat_interleave(group, dim=2)  # [B, T, H, D]
        vr = v1.repeat_interleave(group, dim=2)
        s = torch.einsum("bphd,bjhd->bhpj", q, kr) * m.scale  # [B, H, T, T]
        s = s.masked_fill(~real_mask, float("-inf"))
        extra = [torch.einsum("bphd,bphd->bhp", q, c.repeat_interleave(group, dim=2))[..., None] * m.scale
                 for c in chain_k]  # each [B, H, T, 1]
        w = torch.softmax(torch.cat([s, *extra], dim=-1), dim=-1)
        o = torch.einsum("bhpj,bjhd->bphd", w[..., :t], vr)  # [B, T, H, D]
        for i, c in enumerate(chain_v):
            o = o + w[..., t + i].permute(0, 2, 1)[..., None] * c.repeat_interleave(group, dim=2)
        o = o.reshape(b, t, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(b, t, -1))
        x = x + m.o_proj(o)
        x = x + block.ffn(block.ffn_norm(x))
        y = head.norm(x)  # [B, T, H]
        out.append(model.lm_head(y).float())
        h = y
    return out
