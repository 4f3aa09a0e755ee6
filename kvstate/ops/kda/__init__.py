"""KDA (Kimi Delta Attention): the gated delta rule with a per-channel decay g [B, T, HV, K].

naive_kda (the truth, token by token), chunk_kda (prefill/training, matmuls),
recurrent_kda (decode: one or a few tokens per sequence, optional per-token states).
"""

from kvstate.ops.kda.chunk import chunk_kda
from kvstate.ops.kda.naive import naive_kda
from kvstate.ops.kda.recurrent import recurrent_kda

__all__ = ["chunk_kda", "naive_kda", "recurrent_kda"]
