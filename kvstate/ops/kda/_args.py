"""Argument checks and input preparation shared by the three KDA forms (naive, chunk, recurrent).

KDA (Kimi Delta Attention) is the gated delta rule with a per-channel log-decay g [B, T, HV, K].
Every form validates its inputs the same way (ValueError naming the argument) and picks the
compute dtype: fp32, or fp64 when an input is fp64 (so tests can run a whole form in fp64).
q/k normalization (optional L2 norm, scale, grouped key heads repeated to the value heads) is a
separate step, `KdaInputs.qk` / `norm_qk`, so the chunk form can apply it slab by slab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstate.ops._common import check, check_cu_seqlens, check_qkv, l2norm, num_sequences, repeat_heads

L2_EPS = 1e-6


@dataclass
class KdaInputs:
    """Validated inputs. v, g, beta, state are in the compute dtype; q, k are as given."""

    q: torch.Tensor  # [B, T, H, K]
    k: torch.Tensor  # [B, T, H, K]
    v: torch.Tensor  # [B, T, HV, V]
    g: torch.Tensor  # [B, T, HV, K], log-decay (<= 0)
    beta: torch.Tensor  # [B, T, HV]
    state: torch.Tensor | None  # [N, HV, K, V] or None (zeros)
    num_seqs: int  # N
    scale: float
    l2norm: bool
    dtype: torch.dtype  # compute dtype (float32 or float64)
    out_dtype: torch.dtype  # dtype of the returned output (the dtype of q)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [..., K] -> (scale * q, k) in the compute dtype, L2-normed (in fp32 at least) if asked."""
        q, k = q.to(self.dtype), k.to(self.dtype)
        if not self.l2norm:
            return q * self.scale, k
        # x / sqrt(sum x^2 + eps), as fla and transformers compute it; the scale rides along
        q = q * (torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS) * self.scale)
        return q, l2norm(k, L2_EPS)

    def qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [..., H, K] -> norm_qk, with the key heads repeated to the HV value heads."""
        q, k = self.norm_qk(q, k)
        hv = self.v.shape[2]
        return repeat_heads(q, hv, dim=q.dim() - 2), repeat_heads(k, hv, dim=k.dim() - 2)

    def zero_state(self) -> torch.Tensor:
        """The initial state, zeros when none was given: [N, HV, K, V]."""
        if self.state is not None:
            return self.state
        return self.v.new_zeros(self.num_seqs, self.v.shape[2], self.q.shape[3], self.v.shape[3])


def prepare(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
            pool: bool = False) -> KdaInputs:
    """Validate the contract's arguments; v, g, beta and the state go to the compute dtype.

    pool: `initial_state` is a pool of any number of rows (indexed by the recurrent form's
    state_indices); it is then left as given (`state` is None)."""
    b, t, h, dk, hv, dv = check_qkv(q, k, v)
    check("g", g, shape=(b, t, hv, dk))
    check("beta", beta, shape=(b, t, hv))
    check_cu_seqlens(cu_seqlens, b, t)
    n = num_sequences(b, cu_seqlens)
    if initial_state is not None:
        check("initial_state", initial_state, shape=(None if pool else n, hv, dk, dv))
    dtypes = [x.dtype for x in (q, k, v, g, beta)]
    dtype = torch.float64 if torch.float64 in dtypes else torch.float32
    return KdaInputs(q=q, k=k, v=v.to(dtype), g=g.to(dtype), beta=beta.to(dtype),
                     state=None if initial_state is None or pool else initial_state.to(dtype), num_seqs=n,
                     scale=dk**-0.5 if scale is None else float(scale), l2norm=bool(use_qk_l2norm_in_kernel),
                     dtype=dtype, out_dtype=dtypes[0])
