"""Gated linear attention with a scalar log decay per value head: S <- e^g S + k v^T, o = S^T (scale q)."""

from kvstate.ops.gated_linear_attention.chunk import chunk_gated_linear_attention
from kvstate.ops.gated_linear_attention.naive import naive_gated_linear_attention
from kvstate.ops.gated_linear_attention.recurrent import recurrent_gated_linear_attention

__all__ = ["chunk_gated_linear_attention", "naive_gated_linear_attention", "recurrent_gated_linear_attention"]
