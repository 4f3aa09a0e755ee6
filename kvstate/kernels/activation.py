"""Opt-in activation precision of the bf16-weight linears on CPUs with AVX512_BF16 (Zen 4 and later).

By default the kernels widen bf16 weights exactly and keep fp32 math. `set_activation_dtype("bf16")`
(what `LLM(..., activation_dtype="bf16")` and `--activation-dtype bf16` call)
rounds each linear's input to bf16 and uses vdpbf16ps, as llama.cpp's bf16 path does: the like-for-like
comparison with it, at a relative error of about 2^-9 of sum |w x| per output (`kvstate bench engine
--activation-dtype bf16` reports it against the exact mode). "bf16x3" splits x into three bf16
parts (24 significant bits) for the same instruction: near-exact, not bit-equal to the default.
The setting is process-wide (the compiled decode blocks' linears follow it too; with "bf16" the
larger row counts of prefill run the extension's AVX512_BF16 GEMM, or torch's bf16 GEMM where the
kernels' ISA is AMX); int8 and fp32 weights, AMX and AVX2 paths keep fp32 math.
"""

from __future__ import annotations

from kvstate.errors import KvstateError

# name -> bf16 parts of x for the kernel (0: the fp32 path)
PARTS = {"fp32": 0, "bf16": 1, "bf16x3": 3}
# True while "bf16" is set: the rows past the skinny kernel's (prefill) then run a bf16 GEMM too
# (dispatch.py): the extension's (`own_gemm`: its automatic ISA is AVX-512, so vdpbf16ps, fp32
# output), else torch's, which also rounds each output to bf16 before it is widened back.
bf16_gemm = False
own_gemm = False
_ORDER = ("amx", "avx512", "avx2")


def available() -> bool:
    """The extension is loaded and the CPU has AVX512_BF16."""
    from kvstate.kernels import _ext

    ext = _ext.load()
    return ext is not None and bool(ext.has_avx512_bf16())


def set_activation_dtype(name: str) -> None:
    """"fp32" (exact, the default), "bf16" or "bf16x3" for every later bf16-weight linear of this process."""
    if name not in PARTS:
        raise KvstateError(f"activation dtype {name!r}: expected one of {', '.join(PARTS)}")
    from kvstate.kernels import _ext

    ext = _ext.load()
    if PARTS[name] and not available():
        why = _ext.unavailable_reason() if ext is None else "this CPU has no AVX512_BF16"
        raise KvstateError(f"activation dtype {name}: needs the compiled kernels on a CPU with AVX512_BF16 ({why})")
    if ext is not None:
        ext.set_activation_parts(PARTS[name])
    global bf16_gemm, own_gemm
    bf16_gemm = name == "bf16"
    own_gemm = bf16_gemm and _auto_isa(ext) == "avx512"


def _auto_isa(ext) -> str | None:
    """The ISA the extension's "auto" runs: the best it has within its cap (KVSTATE_KERNELS)."""
    cap = ext.isa_cap()
    allowed = [i for i in ext.isas() if cap == "auto" or _ORDER.index(i) >= _ORDER.index(cap)]
    return allowed[0] if allowed else None


def activation_dtype() -> str:
    """The setting in force ("fp32" where the extension is missing)."""
    from kvstate.kernels import _ext

    ext = _ext.peek()
    parts = ext[0].activation_parts() if ext and ext[0] is not None else 0
    return next(k for k, v in PARTS.items() if v == parts)

