"""Causal depthwise conv1d (the short conv before Mamba / GatedDeltaNet / KDA mixers): the
full-sequence form (prefill, varlen, differentiable) and the in-place decode update."""

from kvstate.ops.conv.causal_conv1d import causal_conv1d
from kvstate.ops.conv.update import causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_update"]
