"""Opt-in activation precision of the bf16-weight linears on CPUs with AVX512_BF16 (Zen 4 and later).

By default the kernels widen bf16 weights exactly and keep fp32 math. `set_activation_dtype("bf16")`
(what `LLM(..., activation_dtype="bf16")` and `--activation-dtype bf16` call)
rounds each linear's input to bf16 and uses vdpbf16ps, as llama.cpp's bf16 path does: the like-for-like
comparison with it, at a relative error of about 2^-9 of sum |w x| per output (`kvstate bench engine
--activation-dtype bf16` reports it against the exact mode). "bf16x3" splits x into three bf16
parts (24 significant bits) for the same instruction: near-exact, not bit-equal to the default.
The setting is process-wide (the compiled decode blocks' linears follow it too). From 64 rows
(prefill) bf16 weights run the extension's AVX512_BF16 GEMM in every mode, x in three bf16 parts for
fp32 math (as the AMX kernel does); where the kernels' ISA is AMX the prefill keeps torch's GEMMs (bf16
in the "bf16" mode). int8 and fp32 weights, AMX and AVX2 paths keep fp32 math.

"q8" concerns the GGML block weights only (a GGUF file's Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, or
`--weight-dtype q8_0|q4_0|q4_k`): llama.cpp's arithmetic, each linear's input quantized to 8 bits per
block (block_q8_0 / block_q8_K) and integer dot products (`kernels.ggml_q8` is its plain form). It
serves up to `blocks.MAX_ROWS` rows (decode, speculative verify); the prefill's GEMMs of the dequantized
tiles round x and the tiles to bf16 where the CPU has AVX512_BF16 (torch's bf16 GEMM; more precise than
llama.cpp's 8-bit prefill) and stay fp32 elsewhere. bf16, int8 and fp32 weights keep their fp32 math
under it. It needs the
compiled kernels and AVX2 (AVX-512 VNNI where the CPU has it).
"""

from __future__ import annotations

from kvstate.errors import KvstateError

# name -> bf16 parts of x for the bf16-weight kernel (0: the fp32 path); "q8" leaves them in fp32
PARTS = {"fp32": 0, "bf16": 1, "bf16x3": 3, "q8": 0}
# True while "bf16" is set: where the extension's GEMM does not serve the rows past the skinny
# kernel's (prefill), they run torch's bf16 GEMM, which also rounds each output to bf16.
bf16_gemm = False
# True while GGML block weights' prefill tiles run as bf16 GEMMs ("bf16"; "q8" on AVX512_BF16 CPUs)
blocks_bf16_gemm = False
# Whether the extension's AVX512_BF16 GEMM serves those rows in every mode (x in 3 bf16 parts for
# fp32 math, 1 for "bf16"): its automatic ISA is AVX-512 on a CPU with AVX512_BF16. None: not yet
# looked up (gemm_serves).
own_gemm: bool | None = None
_ORDER = ("amx", "avx512", "avx2")


def available() -> bool:
    """The extension is loaded and the CPU has AVX512_BF16."""
    from kvstate.kernels import _ext

    ext = _ext.load()
    return ext is not None and bool(ext.has_avx512_bf16())


def set_activation_dtype(name: str) -> None:
    """"fp32" (exact, the default), "bf16" or "bf16x3" for every later bf16-weight linear of this process,
    "q8" for every later GGML-block linear of up to `blocks.MAX_ROWS` rows."""
    if name not in PARTS:
        raise KvstateError(f"activation dtype {name!r}: expected one of {', '.join(PARTS)}")
    from kvstate.kernels import _ext

    ext = _ext.load()
    if PARTS[name] and not available():
        why = _ext.unavailable_reason() if ext is None else "this CPU has no AVX512_BF16"
        raise KvstateError(f"activation dtype {name}: needs the compiled kernels on a CPU with AVX512_BF16 ({why})")
    if name == "q8" and not q8_available():
        why = _ext.unavailable_reason() if ext is None else "this CPU has no AVX2"
        raise KvstateError(f"activation dtype q8: needs the compiled kernels on a CPU with AVX2 ({why})")
    if ext is not None:
        ext.set_activation_parts(PARTS[name])
        ext.set_q8_activations(name == "q8")
    global bf16_gemm, blocks_bf16_gemm
    bf16_gemm = name == "bf16"
    # "q8" is llama.cpp's arithmetic, whose prefill multiplies 8-bit activations: the block weights'
    # prefill tiles run as bf16 GEMMs then (closer to exact than q8), where the CPU has AVX512_BF16
    blocks_bf16_gemm = bf16_gemm or (name == "q8" and available())


def q8_available() -> bool:
    """The extension is loaded and serves the "q8" mode here (it needs AVX2)."""
    from kvstate.kernels import _ext

    ext = _ext.load()
    return ext is not None and hasattr(ext, "set_q8_activations") and "avx2" in ext.isas()


def gemm_serves(chosen: str) -> bool:
    """The extension's GEMM serves any number of rows of bf16 weights for the backend `chosen`
    (dispatch.choice(): "auto" or "avx512"; on AMX machines "auto" keeps torch's GEMMs)."""
    global own_gemm
    if own_gemm is None:
        from kvstate.kernels import _ext

        ext = _ext.load()
        own_gemm = ext is not None and bool(ext.has_avx512_bf16()) and _auto_isa(ext) == "avx512"
    return own_gemm if chosen == "auto" else chosen == "avx512" and available()


def _auto_isa(ext) -> str | None:
    """The ISA the extension's "auto" runs: the best it has within its cap (KVSTATE_KERNELS)."""
    cap = ext.isa_cap()
    allowed = [i for i in ext.isas() if cap == "auto" or _ORDER.index(i) >= _ORDER.index(cap)]
    return allowed[0] if allowed else None


def activation_dtype() -> str:
    """The setting in force ("fp32" where the extension is missing)."""
    from kvstate.kernels import _ext

    ext = _ext.peek()
    if not ext or ext[0] is None:
        return "fp32"
    if ext[0].q8_activations():
        return "q8"
    return next(k for k, v in PARTS.items() if v == ext[0].activation_parts())

