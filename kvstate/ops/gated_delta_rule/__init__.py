"""Gated delta rule (Gated DeltaNet, Qwen3.5 / Qwen3-Next): decay, then the delta write, then the read."""

from kvstate.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
from kvstate.ops.gated_delta_rule.naive import naive_gated_delta_rule
from kvstate.ops.gated_delta_rule.recurrent import recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "naive_gated_delta_rule", "recurrent_gated_delta_rule"]
