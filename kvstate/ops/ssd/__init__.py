"""SSD, the Mamba-2 scan: gated linear attention with q = C, k = B, v = x dt, g = dt A, plus D x."""

from kvstate.ops.ssd._args import discretize
from kvstate.ops.ssd.chunk import chunk_ssd
from kvstate.ops.ssd.naive import naive_ssd
from kvstate.ops.ssd.recurrent import recurrent_ssd

__all__ = ["discretize", "chunk_ssd", "naive_ssd", "recurrent_ssd"]
