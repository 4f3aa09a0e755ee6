"""Bench cases for the Mamba-1 selective scan and the causal depthwise conv1d.

References (transformers' torch fallbacks, importable functions, called on the same inputs in
their own channel-first layout, prepared outside the timed call): `mamba_selective_scan` and
`mamba_selective_state_update` from modeling_jamba (Jamba's and Mamba's slow path), and
`causal_conv1d_fn` / `causal_conv1d_update` from modeling_qwen3_5 (the same code is copied into
the Jamba, Mamba-2 and Kimi Linear files). Shapes are Jamba-like: D = 2 * hidden, N = 16, W = 4.

FLOPs of the scan: it has no matmul, so we count its useful elementwise FLOPs, 6 per (t, d, n)
(dt*A, x*B, h*a + s, y += h*C), exp not counted; it is exp- and latency-bound, not GEMM-bound.
Decode forms and the conv are memory-bound: bytes = state read + written once plus inputs/outputs.
"""

from __future__ import annotations

from kvstate.bench.ops import Case

F32 = 4


def _scan_inputs(b, t, d, n, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(u=r(b, t, d), delta=r(b, t, d), A=-torch.exp(r(d, n) * 0.5), B=r(b, t, n), C=r(b, t, n),
                D=r(d), z=r(b, t, d), delta_bias=r(d) - 2)


def _scan_chunk(t, d, n=16):
    def setup():
        from transformers.models.jamba.modeling_jamba import mamba_selective_scan

        from kvstate.ops.selective_scan import chunk_selective_scan

        x = _scan_inputs(1, t, d, n)
        cf = {k: x[k].transpose(1, 2).contiguous() for k in ("u", "delta", "B", "C", "z")}  # [1, D|N, T]

        def ours():
            return chunk_selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], D=x["D"], z=x["z"],
                                        delta_bias=x["delta_bias"], delta_softplus=True, output_final_state=True)

        def ref():
            return mamba_selective_scan(cf["u"], cf["delta"], x["A"], cf["B"], cf["C"], D=x["D"], z=cf["z"],
                                        delta_bias=x["delta_bias"], delta_softplus=True, return_last_state=True)

        return ours, ref

    return Case("selective_scan", "chunk", f"B=1 T={t} D={d} N={n}", t, setup, flops=6.0 * t * d * n,
                reference="transformers mamba_selective_scan (Jamba slow path)", target="faster than reference")


def _scan_decode(seqs, d, n=16):
    def setup():
        from transformers.models.jamba.modeling_jamba import mamba_selective_state_update

        from kvstate.ops.selective_scan import recurrent_selective_scan

        x = _scan_inputs(seqs, 1, d, n)
        import torch

        state = torch.randn(seqs, d, n) * 0.1
        hf_state = state.clone()

        def ours():
            return recurrent_selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], D=x["D"], z=x["z"],
                                            delta_bias=x["delta_bias"], delta_softplus=True,
                                            initial_state=state, output_final_state=True)

        def ref():
            return mamba_selective_state_update(hf_state, x["u"][:, 0], x["delta"][:, 0], x["A"], x["B"][:, 0],
                                                x["C"][:, 0], x["D"], z=x["z"][:, 0], dt_bias=x["delta_bias"],
                                                dt_softplus=True)

        return ours, ref

    moved = 2 * seqs * d * n * F32 + 4 * seqs * d * F32 + 2 * seqs * n * F32  # state r+w; u, delta, z, y; B, C
    return Case("selective_scan", "recurrent", f"{seqs} seqs x 1 token D={d} N={n}", seqs, setup, bytes=moved,
                reference="transformers mamba_selective_state_update", target="faster than reference")


def _conv_prefill(t, d, w=4):
    def setup():
        import torch
        from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

        from kvstate.ops.conv import causal_conv1d

        g = torch.Generator().manual_seed(1)
        x, weight, bias = torch.randn(1, t, d, generator=g), torch.randn(d, w, generator=g), torch.randn(d, generator=g)
        x_cf = x.transpose(1, 2).contiguous()  # the reference's layout [1, D, T], its best case
        return (lambda: causal_conv1d(x, weight, bias, activation="silu", output_final_state=True),
                lambda: causal_conv1d_fn(x_cf, weight, bias, activation="silu"))

    return Case("causal_conv1d", "prefill", f"B=1 T={t} D={d} W={w} silu", t, setup, bytes=2.0 * t * d * F32,
                reference="transformers causal_conv1d_fn (F.conv1d)", target="faster than reference")


def _conv_update(seqs, d, w=4):
    def setup():
        import torch
        from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update as hf_update

        from kvstate.ops.conv import causal_conv1d_update

        g = torch.Generator().manual_seed(2)
        x, weight, bias = torch.randn(seqs, d, generator=g), torch.randn(d, w, generator=g), torch.randn(d, generator=g)
        state, hf_state = torch.randn(seqs, d, w, generator=g), torch.randn(seqs, d, w, generator=g)
        x_cf = x[:, :, None].contiguous()
        return (lambda: causal_conv1d_update(x, state, weight, bias, activation="silu"),
                lambda: hf_update(x_cf, hf_state, weight, bias, activation="silu"))

    moved = 2 * seqs * d * w * F32 + 2 * seqs * d * F32  # state r+w, x, y
    return Case("causal_conv1d", "update", f"{seqs} seqs x 1 token D={d} W={w} silu", seqs, setup, bytes=moved,
                reference="transformers causal_conv1d_update", target="faster than reference")


def cases(quick: bool) -> list[Case]:
    if quick:
        return [_scan_chunk(256, 512), _scan_decode(8, 1024), _conv_prefill(256, 1024), _conv_update(8, 1024)]
    return [_scan_chunk(2048, 2048), _scan_chunk(2048, 4096), _scan_decode(32, 4096), _scan_decode(32, 8192),
            _conv_prefill(2048, 8192), _conv_update(32, 8192)]
