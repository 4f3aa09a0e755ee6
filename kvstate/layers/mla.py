"""Multi-head latent attention (DeepSeek-V2 MLA) as Kimi Linear uses it: no RoPE (mla_use_nope).

Per token the layer caches one latent row [kv_lora_rank + qk_rope_head_dim] in the paged pool
("latent"): the RMS-normed compressed KV c and the shared key part k_r (which Kimi does not
rotate). Per head, keys are [W_UK c, k_r] and values W_UV c, with W_UK / W_UV the two row blocks
of kv_b_proj; queries come from q_proj (or q_a_proj -> norm -> q_b_proj when q_lora_rank is set).

Two exact forms of the same attention:
- prefill decompresses each sequence's latents into per-head K and V (cheapest when many
  queries share them);
- decode absorbs W_UK into the query and W_UV into the output, q' = [W_UK^T q_nope, q_rope],
  o = W_UV softmax(q' [c, k_r]^T) c: one shared "KV head" of the latent itself, so a step reads
  the latents once and never decompresses the context (about R / (H * (nope + v)) of the FLOPs).
"""

from __future__ import annotations

import torch
from torch import nn

from kvstate.layers.norm import RMSNorm
from kvstate.ops.attention import gather_kv, paged_attention, sdpa_one, write_kv

LATENT_NORM_EPS = 1e-6  # transformers builds kv_a_layernorm / q_a_layernorm with the default eps, not rms_norm_eps


class MLA(nn.Module):
    weight_read = ("kv_b_proj",)  # projections read as a tensor, not called (kernels.quant keeps them)

    def __init__(self, hidden_size: int, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, *, q_lora_rank: int | None = None, bias: bool = False):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        qk_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk_dim, bias=False)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        self.scale = qk_dim**-0.5

    @classmethod
    def from_spec(cls, spec, hidden_size: int, opts) -> "MLA":
        return cls(hidden_size, spec.num_heads, spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim,
                   spec.v_head_dim, q_lora_rank=spec.q_lora_rank, bias=spec.bias)

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope + self.rope)
        c, k_r = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        write_kv(cache.latent, torch.cat([self.kv_a_layernorm(c), k_r], dim=-1), batch.kv_indices)
        if batch.decode_only:
            o = self._absorbed(q, cache.latent, batch)
        else:
            o = self._decompressed(q, cache.latent, batch)
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, R] and W_UV [H, v, R]: the per-head row blocks of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        w = w.to(self.kv_a_layernorm.weight.dtype)  # bf16-stored weights widen exactly for the bmm
        return w[:, : self.nope], w[:, self.nope :]

    def _absorbed(self, q: torch.Tensor, latent: torch.Tensor, batch) -> torch.Tensor:
        """q [T, H, nope + rope] -> o [T, H, v], attending over the latents as one shared KV head."""
        w_uk, w_uv = self._kv_b()
        q_lat = torch.bmm(q[..., : self.nope].transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, R]
        q_abs = torch.cat([q_lat, q[..., self.nope :]], dim=-1)  # [T, H, R + rope]
        pool = latent.unsqueeze(2)  # [num_blocks, block_size, 1, R + rope]
        o_lat = paged_attention(q_abs, pool, pool[..., : self.kv_lora_rank], batch, scale=self.scale)  # [T, H, R]
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]

    def _decompressed(self, q: torch.Tensor, latent: torch.Tensor, batch) -> torch.Tensor:
        """q [T, H, nope + rope] -> o [T, H, v]: per sequence, expand its latents into K, V and attend."""
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        cu = batch.token_offsets
        for i, (q_len, kv_len) in enumerate(zip(batch.query_lens, batch.kv_lens)):
            if q_len == 0:
                continue
            lat = gather_kv(latent, batch.block_tables[i], kv_len)  # [L, R + rope]
            kv = self.kv_b_proj(lat[:, : self.kv_lora_rank]).view(kv_len, self.num_heads, -1)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [L, H, nope], [L, H, v]
            k_r = lat[:, None, self.kv_lora_rank :].expand(kv_len, self.num_heads, self.rope)
            k = torch.cat([k_nope, k_r], dim=-1).transpose(0, 1)  # [H, L, nope + rope]
            qi = q[cu[i] : cu[i + 1]].transpose(0, 1)  # [H, q_len, nope + rope]
            ctx = kv_len - q_len
            if ctx == 0:
                o = sdpa_one(qi, k, v.transpose(0, 1), self.scale, causal=True)
            else:
                pos = torch.arange(kv_len, device=q.device)
                allowed = pos[None, :] <= pos[ctx:, None]  # [q_len, kv_len]: query t sees keys 0..ctx+t
                o = sdpa_one(qi, k, v.transpose(0, 1), self.scale, mask=allowed)
            out[cu[i] : cu[i + 1]] = o.transpose(0, 1)
        return out
