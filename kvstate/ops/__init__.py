"""Token-mixer ops: pure tensor functions, one folder per recurrence (fla's public names).

For op in linear_attention, gated_linear_attention, delta_rule, gated_delta_rule, kda, ssd and
selective_scan there are three forms with one argument order:
    naive_<op>      fp32 per-token reference (the truth the others are tested against)
    chunk_<op>      matmul form for prefill and training (differentiable)
    recurrent_<op>  decode: one or a few tokens per sequence, can return every intermediate state
plus causal_conv1d (full sequence, carries the conv state) and causal_conv1d_update (one step).
Layouts: tokens [B, T, H, D] (packed varlen: [1, sum T, H, D] with cu_seqlens); state
[N, HV, K, V] in fp32. Names resolve lazily so importing one op does not import them all.
"""

from __future__ import annotations

import importlib

_OPS = ("linear_attention", "gated_linear_attention", "delta_rule", "gated_delta_rule", "kda", "ssd",
        "selective_scan")
_WHERE = {f"{form}_{op}": f"kvstate.ops.{op}" for op in _OPS for form in ("naive", "chunk", "recurrent")}
_WHERE.update(causal_conv1d="kvstate.ops.conv", causal_conv1d_update="kvstate.ops.conv")

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'kvstate.ops' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
