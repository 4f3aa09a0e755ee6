"""Bench cases for KDA (Kimi Delta Attention): chunk (prefill) and recurrent (decode) forms.

References: transformers' Kimi Linear fallbacks `chunk_kimi_delta_attention` and
`recurrent_kimi_delta_attention`, on the same inputs in the same process. They need as many key
heads as value heads, so q and k are repeated to the value heads before the timed call (as our
ops do inside). transformers' chunk form broadcasts a [heads, chunks, 64, 64, K] tensor (4.3 GB
at T = 4096 with 32 heads), so its timed call runs 4 heads at a time to keep ~1.6 GB in flight;
the work is the same, head by head.

Gates follow fla's tests: g = logsigmoid(randn) (about -0.8 nats per token and channel);
a second prefill case with 10x steeper gates sends every 16-token block through the exact
(broadcast) path of kvstate.ops.kda.intra, the worst case of our chunk form.

FLOPs of the chunk algorithm per chunk of C tokens and value head (useful, triangular halves
counted once, the same count for both sides): two intra-chunk score matrices C^2 K each, the
WY solve C^2 (K + V), the inter-chunk W S, K^T U and Q S products 6 C K V, and P U C^2 V.
Decode bytes: the fp32 state read and written once, plus q, k, v, g, beta and o. The functional
call returns a new 64 MiB state, whose first-touch page faults cost several times the copy; the
engine's call updates its state slots in place (inplace_final_state), the second decode case.
"""

from __future__ import annotations

from kvstate.bench.ops import Case

F32 = 4
REF_HEADS_PER_CALL = 4


def _inputs(b, t, h, hv, dk, dv, *, gate=1.0, seed=0):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(b, t, h, dk), k=r(b, t, h, dk), v=r(b, t, hv, dv), g=F.logsigmoid(r(b, t, hv, dk)) * gate,
                beta=torch.rand(b, t, hv, generator=gen), initial_state=r(b, hv, dk, dv) * 0.1)


def chunk_flops(t: int, hv: int, dk: int, dv: int, c: int = 64) -> float:
    per_chunk = c * c * (2 * dk + (dk + dv) + dv) + 6 * c * dk * dv
    return float(-(-t // c) * hv * per_chunk)


def _chunk(t, h, hv, d, *, gate=1.0, reference=True):
    def setup():
        import torch
        from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

        from kvstate.ops.kda import chunk_kda

        x = _inputs(1, t, h, hv, d, d, gate=gate)
        rep = {n: x[n].repeat_interleave(hv // h, dim=2) for n in ("q", "k")}

        def ours():
            return chunk_kda(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)

        def ref():
            outs = []
            for a in range(0, hv, REF_HEADS_PER_CALL):
                hs = slice(a, a + REF_HEADS_PER_CALL)
                outs.append(chunk_kimi_delta_attention(
                    rep["q"][:, :, hs], rep["k"][:, :, hs], x["v"][:, :, hs], x["g"][:, :, hs], x["beta"][:, :, hs],
                    initial_state=x["initial_state"][:, hs], output_final_state=True, use_qk_l2norm_in_kernel=True))
            return torch.cat([o for o, _ in outs], dim=2), torch.cat([s for _, s in outs], dim=1)

        return ours, (ref if reference else None)

    shape = f"B=1 T={t} H={h}/{hv} K=V={d}" + (f" g x{gate:g} (exact path)" if gate != 1.0 else "")
    return Case("kda", "chunk", shape, t, setup, flops=chunk_flops(t, hv, d, d),
                reference="transformers chunk_kimi_delta_attention" if reference else "",
                target=">= 5x transformers" if reference else "")


def _decode(seqs, h, hv, d, tokens=1, inplace=False):
    def setup():
        from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

        from kvstate.ops.kda import recurrent_kda

        x = _inputs(seqs, tokens, h, hv, d, d)
        rep = {n: x[n].repeat_interleave(hv // h, dim=2) for n in ("q", "k")}
        pool = x["initial_state"].clone()  # the engine's state slots, updated in place

        def ours():
            if inplace:
                return recurrent_kda(*(x[n] for n in ("q", "k", "v", "g", "beta")), initial_state=pool,
                                     inplace_final_state=True, use_qk_l2norm_in_kernel=True)
            return recurrent_kda(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)

        def ref():
            return recurrent_kimi_delta_attention(rep["q"], rep["k"], x["v"], x["g"], x["beta"],
                                                  initial_state=x["initial_state"], output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)

        return ours, ref

    state = seqs * hv * d * d * F32
    io = seqs * tokens * (2 * h * d + hv * (d + d + 1 + d)) * F32  # q, k, v, g, beta, o
    shape = f"{seqs} seqs x {tokens} tok, H={h}/{hv} K=V={d}" + (", in place" if inplace else ", new state")
    return Case("kda", "recurrent", shape, seqs * tokens, setup,
                bytes=2 * state + io, reference="transformers recurrent_kimi_delta_attention",
                target="bandwidth")


def cases(quick: bool) -> list[Case]:
    if quick:
        return [_chunk(512, 4, 8, 128), _decode(8, 4, 8, 128)]
    return [_chunk(4096, 16, 32, 128), _chunk(4096, 16, 32, 128, gate=10.0, reference=False),
            _decode(32, 16, 32, 128), _decode(32, 16, 32, 128, inplace=True), _decode(32, 16, 32, 128, tokens=4)]
