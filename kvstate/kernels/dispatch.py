"""`linear(x, weight, bias)`: the compiled skinny GEMM for decode-sized inputs, torch otherwise.

The extension serves CPU float32 x with at most `MAX_ROWS` rows (all leading dimensions
flattened; `MAX_ROWS_BF16` for bf16 and int8 weights) and a contiguous float32, bfloat16 or int8
(with its per-row `scale`, `kernels.quant`) weight, outside autograd. Everything else, and
everything when the extension is missing, runs `F.linear` in x's dtype (a bf16 weight is upcast
first, which is exact; an int8 one is dequantized, q * scale). The choice can be
forced: `KVSTATE_KERNELS=torch|amx|avx512|avx2|auto` in the environment (read at import), or
`with kernels.backend("torch"):` (tests), which wins. `KVSTATE_KERNELS=avx2` (or `avx512`) caps
every kernel of the extension at that ISA, not only these calls: the compiled decode blocks'
linears and the gated delta rule's per-head kernel too (the cap is set when the extension loads).
torch's own kernels (prefill's GEMMs) keep theirs: cap them with torch's and its libraries'
variables (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import torch
import torch.nn.functional as F

from kvstate.kernels import _ext, activation
from kvstate.kernels._ext import BACKEND_ENV as ENV
from kvstate.kernels._ext import backend_from_env
from kvstate.kernels.threads import _wide
from kvstate.profiling import timed

# Up to these rows the kernel beats F.linear: with fp32 weights the gain shrinks to a tie at 64 rows;
# with bf16 weights torch must first upcast them (or use its slow bf16 GEMM), so the kernel stays
# well ahead at 64 (one call: the AMX path streams the weights once for any number of rows)
# (docs/benchmarks.md, "Kernel history").
MAX_ROWS = 32
MAX_ROWS_BF16 = 64
CHOICES = ("auto", "torch", "amx", "avx512", "avx2")

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvstate_kernels_backend", default=None)

# Read once, at import: a decode step makes ~200 calls and an environment lookup costs as much
# as the rest of the dispatch. A bad value is reported by the first call, not by the import.
_DEFAULT = backend_from_env()
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


def choice() -> str:
    """The backend in force: `backend(name)`'s, else the environment's (KVSTATE_KERNELS), else "auto"."""
    name = _forced.get() or _DEFAULT
    if name not in CHOICES:
        raise ValueError(f"{ENV}={name!r}: expected one of {', '.join(CHOICES)}")
    return name


@contextlib.contextmanager
def backend(name: str):
    """Force a backend inside the block: "torch" (the fallback), "amx"/"avx512"/"avx2" (that ISA;
    amx serves bf16 weights only, the rest goes to avx512), "auto" (the best the CPU has). Only the
    calls of `linear` see it; the environment variable's cap holds for every kernel."""
    if name not in CHOICES:
        raise ValueError(f"kernel backend {name!r}: expected one of {', '.join(CHOICES)}")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """The fallback: F.linear in x's dtype (bf16 -> fp32 weights are upcast exactly, int8 ones
    dequantized with their per-row scale)."""
    if scale is not None:
        weight = (weight.to(torch.float32) * scale.to(torch.float32)[:, None]).to(x.dtype)
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return F.linear(x, weight, bias)


def _eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    # Cheapest tests first: this runs for every linear of every step.
    if x.dtype != torch.float32 or weight.dtype not in _WEIGHT_DTYPES or not (x.is_cpu and weight.is_cpu):
        return False
    if weight.dim() != 2 or not weight.is_contiguous():
        return False
    if bias is not None and (not bias.is_cpu or bias.dim() != 1):
        return False
    # The kernel has no backward.
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return False
    return True


@timed("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """y[..., N] = x[..., K] @ weight[N, K]^T + bias, weight float32, bfloat16 or int8 (times its
    per-row `scale`), fp32 math. Inside `threads.small_ops_serial()` the call gets all the threads
    back (it streams the weights)."""
    wide = _wide.get()
    if wide is None:
        return _linear(x, weight, bias, scale)
    torch.set_num_threads(wide)  # ~1 us each way, inline: a context manager would cost more than that
    try:
        return _linear(x, weight, bias, scale)
    finally:
        torch.set_num_threads(1)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            scale: torch.Tensor | None) -> torch.Tensor:
    if (weight.dtype == torch.int8) != (scale is not None):
        raise ValueError("an int8 weight needs its per-row scale, and only an int8 weight takes one")
    chosen = choice()
    if chosen != "torch" and _eligible(x, weight, bias):
        flat = x.dim() == 2
        rows = x.shape[0] if flat else math.prod(x.shape[:-1])
        limit = MAX_ROWS if weight.dtype == torch.float32 else MAX_ROWS_BF16
        if rows > limit and weight.dtype == torch.bfloat16 and activation.gemm_serves(chosen):
            limit = rows  # the extension's AVX512_BF16 GEMM serves any number of rows (activation.py)
        ext = _ext.load() if rows <= limit else None
        if ext is not None:
            if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
                bias = bias.float().contiguous()
            x2 = x if flat else x.reshape(rows, x.shape[-1])  # [M, K]; the extension makes it contiguous
            if scale is not None and (scale.dtype != torch.float32 or not scale.is_contiguous()):
                scale = scale.float().contiguous()
            y = ext.linear(x2, weight, bias, chosen, scale=scale)
            return y if flat else y.reshape(*x.shape[:-1], weight.shape[0])
        if activation.bf16_gemm and weight.dtype == torch.bfloat16:  # the opt-in's prefill (activation.py)
            y = F.linear(x.to(torch.bfloat16), weight).float()
            return y if bias is None else y + bias
    return torch_linear(x, weight, bias, scale)


def info() -> dict:
    """Which path `linear` takes here and why: backend, ISA, the CPU's ISAs, the library."""
    chosen = choice()
    ext = _ext.load()
    isas = list(ext.isas()) if ext is not None else []
    if chosen == "torch":
        return dict(backend="torch", isa=None, isas=isas, reason=f"forced ({ENV}=torch or backend('torch'))",
                    max_rows=MAX_ROWS, library=str(_ext.library()) if ext else None)
    if ext is None:
        return dict(backend="torch", isa=None, isas=[], reason=_ext.unavailable_reason(), max_rows=MAX_ROWS,
                    library=None)
    isa = isas[0] if chosen == "auto" else chosen
    reason = None if isa in isas else f"ISA {isa} not available on this CPU (has {', '.join(isas)})"
    return dict(backend="extension", isa=isa, isas=isas, reason=reason, max_rows=MAX_ROWS,
                max_rows_bf16=MAX_ROWS_BF16, library=str(_ext.library()))
