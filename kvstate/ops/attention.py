"""Softmax attention over a paged KV cache (the full-attention layers of a hybrid model).

The cache of one layer is a pool of blocks: k_cache, v_cache [num_blocks, block_size, Hkv, D].
New K/V rows are written at the batch's `kv_indices`, then each sequence attends over its own
blocks (its `block_tables` row) causally: query token t of a sequence with `c` cached tokens sees
keys 0 .. c + t. Grouped-query heads are handled by SDPA's `enable_gqa` (no repeat of K/V).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstate.profiling import timed


@timed("attention")
def write_kv(cache: torch.Tensor, new: torch.Tensor, kv_indices: torch.Tensor) -> None:
    """cache [num_blocks, block_size, *rest] <- new [T, *rest] at flat rows kv_indices [T]."""
    cache.view(-1, *cache.shape[2:]).index_copy_(0, kv_indices, new.to(cache.dtype))


def gather_kv(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` rows of one sequence's blocks: [length, *rest].

    Consecutive block ids (the common case for a lone sequence) give a view, not a copy.
    """
    block_size = cache.shape[1]
    nb = -(-length // block_size)
    ids = table[:nb]
    first = int(ids[0])
    if nb == 1 or bool((ids == torch.arange(first, first + nb, device=ids.device)).all()):
        return cache[first : first + nb].reshape(-1, *cache.shape[2:])[:length]
    return cache[ids].reshape(-1, *cache.shape[2:])[:length]


@timed("attention")
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch, *,
                    scale: float, fresh: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [T, H, D] (already rotated) -> o [T, H, Dv], reading K/V of every sequence from the pool.
    `fresh`: the step's own K/V rows (k [T, Hkv, D], v [T, Hkv, Dv], as written to the pool); with
    them, a step whose sequences all start from nothing (training batches, whole prompts) attends
    over those rows directly (`_fresh`)."""
    if _all_fresh(batch, fresh, k_cache):
        return _fresh(q, *fresh, batch, scale)
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    if batch.decode_only and batch.num_seqs > 1:
        return _decode_batched(q, k_cache, v_cache, batch, scale, out)
    cu = batch.token_offsets
    for i, (q_len, kv_len) in enumerate(zip(batch.query_lens, batch.kv_lens)):
        if q_len == 0:
            continue
        k = gather_kv(k_cache, batch.block_tables[i], kv_len).transpose(0, 1)  # [Hkv, kv_len, D]
        v = gather_kv(v_cache, batch.block_tables[i], kv_len).transpose(0, 1)
        qi = q[cu[i] : cu[i + 1]].transpose(0, 1)  # [H, q_len, D]
        ctx = kv_len - q_len
        if q_len == 1:  # a decode token sees every key: three ops, no mask, no K/V repeat
            out[cu[i] : cu[i + 1]] = _one_query(qi, k, v, scale).transpose(0, 1)
            continue
        if ctx == 0:
            o = sdpa_one(qi, k, v, scale, causal=True)
        else:
            pos = torch.arange(kv_len, device=q.device)
            allowed = pos[None, :] <= pos[ctx:, None]  # [q_len, kv_len]: query t sees keys 0..ctx+t
            o = sdpa_one(qi, k, v, scale, mask=allowed)
        out[cu[i] : cu[i + 1]] = o.transpose(0, 1)
    return out


def _all_fresh(batch, fresh, k_cache: torch.Tensor) -> bool:
    """No sequence has cached context, and the pool keeps K/V at the step's precision."""
    return fresh is not None and fresh[0].dtype == k_cache.dtype and not any(batch.context_lens)


def _fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch, scale: float) -> torch.Tensor:
    """Causal attention of sequences that start from nothing, each over its own rows of q [T, H, D],
    k [T, Hkv, D], v [T, Hkv, Dv] (split, not sliced: in training, the backward of a slice fills a
    full-size gradient per sequence, and reading K/V back from the pool slices it too)."""
    lens = batch.query_lens
    outs = [sdpa_one(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1), scale, causal=True).transpose(0, 1)
            if qi.shape[0] else qi.new_empty(0, qi.shape[1], vi.shape[-1])
            for qi, ki, vi in zip(q.split(lens), k.split(lens), v.split(lens))]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def sdpa_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool = False,
             mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of one sequence: q [H, Lq, D], k [Hkv, L, D], v [Hkv, L, Dv] -> [H, Lq, Dv]. On CPU the
    flash path streams the scores in blocks; it needs 4-D inputs and one head dim for q, k and v,
    else SDPA takes the math path, which materialises every [Lq, L] score matrix (5.4 GB for one
    8K-token prompt with 8 heads, against 0.3 GB) and runs 2.5x slower. So the inputs get a batch
    dimension, and the narrower of the two head dims is zero-padded (MLA: Dk = nope + rope, Dv):
    zero columns add nothing to q.k or to the output columns kept."""
    dk, dv = q.shape[-1], v.shape[-1]
    if dv < dk:
        v = F.pad(v, (0, dk - dv))
    elif dk < dv:
        q, k = F.pad(q, (0, dv - dk)), F.pad(k, (0, dv - dk))
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=scale,
                                       enable_gqa=True)[0]
    return o if o.shape[-1] == dv else o[..., :dv]


def _one_query(qi: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """qi [H, 1, D], k [Hkv, L, D], v [Hkv, L, Dv] -> [H, 1, Dv]. SDPA's CPU path for one query
    repeats K/V per query head and runs ~10 ops; here the G query heads of a KV head are the rows
    of one matmul (query head h reads KV head h // G, as enable_gqa does)."""
    hkv = k.shape[0]
    qg = qi.reshape(hkv, -1, qi.shape[-1])  # [Hkv, G, D]
    p = torch.softmax(torch.matmul(qg, k.transpose(1, 2)) * scale, dim=-1)  # [Hkv, G, L]
    return torch.matmul(p, v).reshape(qi.shape[0], 1, v.shape[-1])


def _decode_batched(q, k_cache, v_cache, batch, scale, out):
    """One query per sequence: pad every sequence's K/V to the longest and run one SDPA call."""
    n, max_len = batch.num_seqs, max(batch.kv_lens)
    hkv, d, dv = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
    k = k_cache.new_zeros(n, max_len, hkv, d)
    v = v_cache.new_zeros(n, max_len, hkv, dv)
    for i, kv_len in enumerate(batch.kv_lens):
        k[i, :kv_len] = gather_kv(k_cache, batch.block_tables[i], kv_len)
        v[i, :kv_len] = gather_kv(v_cache, batch.block_tables[i], kv_len)
    lens = torch.tensor(batch.kv_lens, device=q.device)
    allowed = (torch.arange(max_len, device=q.device)[None, :] < lens[:, None])[:, None, None, :]  # [N, 1, 1, max_len]
    o = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=allowed, scale=scale, enable_gqa=True)  # [N, H, 1, Dv]
    out.copy_(o[:, :, 0, :])
    return out
