"""Mamba-1 selective scan (per-channel A [D, N]): naive, chunk (prefill, differentiable) and
recurrent (decode) forms with mamba_ssm's `selective_scan_fn` argument names, token-first."""

from kvstate.ops.selective_scan.chunk import chunk_selective_scan
from kvstate.ops.selective_scan.naive import naive_selective_scan
from kvstate.ops.selective_scan.recurrent import recurrent_selective_scan

__all__ = ["chunk_selective_scan", "naive_selective_scan", "recurrent_selective_scan"]
