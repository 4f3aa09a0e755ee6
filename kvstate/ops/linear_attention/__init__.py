"""Linear attention without decay: S <- S + k v^T, o = S^T (scale q)."""

from kvstate.ops.linear_attention.chunk import chunk_linear_attention
from kvstate.ops.linear_attention.naive import naive_linear_attention
from kvstate.ops.linear_attention.recurrent import recurrent_linear_attention

__all__ = ["chunk_linear_attention", "naive_linear_attention", "recurrent_linear_attention"]
