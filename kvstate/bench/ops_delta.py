"""Bench cases for the delta family and SSD: (gated) linear attention, (gated) delta rule, Mamba-2 SSD.

References (transformers' torch fallbacks, called in the same process on the same inputs):
`torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule` (modeling_qwen3_5; for the
plain delta rule with g = 0) and `mamba2_chunk_scan` / `mamba2_selective_state_update`
(modeling_mamba2, the Mamba2 torch path; its state is [B, H, P, N], prepared outside the timed
call). Linear attention and gated linear attention have no transformers function: ours is timed
alone (SSD is the same kernel as gated linear attention and has a reference).

FLOPs (same count for both sides): the useful matmul FLOPs of the chunk algorithm at chunk size
64 (transformers' default for the delta rule), per chunk of C tokens and value head, with key
heads shared by G value heads: q k^T and k k^T 2 C^2 K / G each, the WY/UT products
(I + L)^-1 [beta V | beta e^b K] 2 C^2 (V + K), the state pass w S, k^T v_new and q S 2 C K V each,
and the intra-chunk (q k^T o Gamma) v_new 2 C^2 V; the triangular inverse itself is not counted.
Decode bytes: every state read and written once, plus q, k, v, o. Recurrent forms update a state
pool in place (`inplace_final_state`), as the engine does.
"""

from __future__ import annotations

from kvstate.bench.ops import Case

F32 = 4
C64 = 64


def _delta_flops(t, h, hv, dk, dv, gated_la=False):
    grp, c = hv // h, C64
    if gated_la:  # no delta: q k^T, the chunk's state K^T V, q S, (q k^T) V
        per_chunk = hv * (2 * c * c * dk / grp + 2 * c * dk * dv * 2 + 2 * c * c * dv)
    else:
        per_chunk = hv * (4 * c * c * dk / grp + 2 * c * c * (dk + dv) + 6 * c * dk * dv + 2 * c * c * dv)
    return per_chunk * t / c


def _inputs(b, t, h, hv, dk, dv, seed=0):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(b, t, h, dk), k=r(b, t, h, dk), v=r(b, t, hv, dv), g=F.logsigmoid(r(b, t, hv) + 3.0),
                beta=torch.sigmoid(r(b, t, hv)))


def _delta_chunk(op, t, h, hv, dk, dv):
    gated = op == "gated_delta_rule"

    def setup():
        import torch
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        from kvstate import ops

        x = _inputs(1, t, h, hv, dk, dv)
        g = x["g"] if gated else torch.zeros_like(x["g"])
        fn = ops.chunk_gated_delta_rule if gated else ops.chunk_delta_rule
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"]) if gated else (x["q"], x["k"], x["v"], x["beta"])
        kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
        return (lambda: fn(*args, **kw)), (lambda: torch_chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, x["beta"],
                                                                                **kw))

    return Case(op, "chunk", f"B=1 T={t} H={h}/{hv} K={dk} V={dv}", t, setup, flops=_delta_flops(t, h, hv, dk, dv),
                reference="transformers torch_chunk_gated_delta_rule" + ("" if gated else " (g = 0)"),
                target=">= 3x ref, stretch 60% GEMM" if gated else "faster than reference")


def _delta_decode(op, seqs, h, hv, dk, dv):
    gated = op == "gated_delta_rule"

    def setup():
        import torch
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

        from kvstate import ops

        x = _inputs(seqs, 1, h, hv, dk, dv)
        g = x["g"] if gated else torch.zeros_like(x["g"])
        pool = 0.1 * torch.randn(seqs, hv, dk, dv)
        s0 = pool.clone()
        fn = ops.recurrent_gated_delta_rule if gated else ops.recurrent_delta_rule
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"]) if gated else (x["q"], x["k"], x["v"], x["beta"])

        def ours():
            return fn(*args, initial_state=pool, inplace_final_state=True, use_qk_l2norm_in_kernel=True)

        def ref():
            return torch_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g, x["beta"], initial_state=s0,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)

        return ours, ref

    moved = 2 * seqs * hv * dk * dv * F32 + seqs * (2 * h * dk + 2 * hv * dv) * F32
    return Case(op, "recurrent", f"{seqs} seqs x 1 token H={h}/{hv} K={dk} V={dv}", seqs, setup, bytes=moved,
                reference="transformers torch_recurrent_gated_delta_rule" + ("" if gated else " (g = 0)"),
                target=">= 5x ref, >= 30% BW" if gated else "faster than reference")


def _la(op, form, b, t, h, hv, dk, dv):
    gated = op == "gated_linear_attention"

    def setup():
        import torch

        from kvstate import ops

        x = _inputs(b, t, h, hv, dk, dv)
        args = (x["q"], x["k"], x["v"], x["g"]) if gated else (x["q"], x["k"], x["v"])
        fn = getattr(ops, f"{form}_{op}")
        if form == "chunk":
            return (lambda: fn(*args, output_final_state=True)), None
        pool = 0.1 * torch.randn(b, hv, dk, dv)
        return (lambda: fn(*args, initial_state=pool, inplace_final_state=True)), None

    if form == "chunk":
        return Case(op, form, f"B=1 T={t} H={h}/{hv} K={dk} V={dv}", t, setup,
                    flops=_delta_flops(t, h, hv, dk, dv, gated_la=True), reference="(none in transformers)")
    moved = 2 * b * hv * dk * dv * F32 + b * (2 * h * dk + 2 * hv * dv) * F32
    return Case(op, form, f"{b} seqs x 1 token H={h}/{hv} K={dk} V={dv}", b, setup, bytes=moved,
                reference="(none in transformers)")


def _ssd_inputs(b, t, h, p, g, n, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(x=r(b, t, h, p), dt=r(b, t, h) - 2.0, A=-torch.exp(r(h) * 0.5), B=r(b, t, g, n), C=r(b, t, g, n),
                D=r(h), dt_bias=0.5 * r(h))


def _ssd_chunk(t, h, p, g, n, ref_chunk):
    def setup():
        from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

        from kvstate import ops

        x = _ssd_inputs(1, t, h, p, g, n)
        kw = dict(D=x["D"], dt_bias=x["dt_bias"], dt_softplus=True)
        args = (x["x"], x["dt"], x["A"], x["B"], x["C"])
        return (lambda: ops.chunk_ssd(*args, output_final_state=True, **kw)), \
            (lambda: mamba2_chunk_scan(*args, chunk_size=ref_chunk, return_final_states=True, **kw))

    c, grp = C64, h // g
    flops = h * (2 * c * c * n / grp + 4 * c * n * p + 2 * c * c * p) * t / c
    return Case("ssd", "chunk", f"B=1 T={t} H={h} P={p} G={g} N={n}", t, setup, flops=flops,
                reference=f"transformers mamba2_chunk_scan (chunk {ref_chunk})", target="faster than reference")


def _ssd_decode(seqs, h, p, g, n):
    def setup():
        import torch
        from transformers.models.mamba2.modeling_mamba2 import mamba2_selective_state_update

        from kvstate import ops

        x = _ssd_inputs(seqs, 1, h, p, g, n)
        pool = 0.1 * torch.randn(seqs, h, n, p)
        hf_state = pool.transpose(-1, -2).contiguous()  # transformers' layout [B, H, P, N]
        e = dict(dt=x["dt"][:, 0, :, None].expand(-1, -1, p), A=x["A"][:, None, None].expand(-1, p, n),
                 D=x["D"][:, None].expand(-1, p), dt_bias=x["dt_bias"][:, None].expand(-1, p))

        def ours():
            return ops.recurrent_ssd(x["x"], x["dt"], x["A"], x["B"], x["C"], D=x["D"], dt_bias=x["dt_bias"],
                                     dt_softplus=True, initial_state=pool, inplace_final_state=True)

        def ref():
            return mamba2_selective_state_update(hf_state, x["x"][:, 0], e["dt"], e["A"], x["B"][:, 0], x["C"][:, 0],
                                                 e["D"], dt_bias=e["dt_bias"], dt_softplus=True)

        return ours, ref

    moved = 2 * seqs * h * n * p * F32 + seqs * (2 * h * p + 2 * g * n + h) * F32
    return Case("ssd", "recurrent", f"{seqs} seqs x 1 token H={h} P={p} G={g} N={n}", seqs, setup, bytes=moved,
                reference="transformers mamba2_selective_state_update", target="faster than reference")


def cases(quick: bool) -> list[Case]:
    if quick:
        t, seqs, heads = 512, 4, (4, 8, 64, 64)
        ssd = (512, 16, 32, 2, 64)
    else:
        t, seqs, heads = 4096, 32, (16, 32, 128, 128)  # Qwen3.5 / Qwen3-Next linear layers
        ssd = (2048, 128, 64, 8, 128)  # Nemotron-H-8B Mamba-2 layer
    out = []
    for op in ("gated_delta_rule", "delta_rule"):
        out += [_delta_chunk(op, t, *heads), _delta_decode(op, seqs, *heads)]
    for op in ("gated_linear_attention", "linear_attention"):
        out += [_la(op, "chunk", 1, t, *heads), _la(op, "recurrent", seqs, 1, *heads)]
    out += [_ssd_chunk(*ssd, ref_chunk=256), _ssd_decode(seqs, *ssd[1:])]
    return out
