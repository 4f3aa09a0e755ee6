"""Delta rule: S <- S + k (beta (v - S^T k))^T, o = S^T (scale q)."""

from kvstate.ops.delta_rule.chunk import chunk_delta_rule
from kvstate.ops.delta_rule.naive import naive_delta_rule
from kvstate.ops.delta_rule.recurrent import recurrent_delta_rule

__all__ = ["chunk_delta_rule", "naive_delta_rule", "recurrent_delta_rule"]
