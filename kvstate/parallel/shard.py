"""Which part of every full parameter a rank holds, and the loader that reads only that part.

A `Cut` says: along dimension `dim` the rank's parameter is these ranges of the full one, in
order. Column-parallel projections (q/k/v, the linear mixers' input projections, MLP gate/up,
embedding and LM head rows) are cut along dim 0, segment by segment where one matrix holds
several ([q|k|v] of GDN and KDA, [z|x|B|C|dt] of Mamba-2, [x|z] of Mamba-1, and their conv
channels); row-parallel ones (o_proj, out_proj, down_proj, Mamba-1's x_proj) along dim 1; the
routed experts along their expert dimension. Parameters without a Cut are replicated; the biases
of row-parallel projections are kept on rank 0 and zero elsewhere (their outputs are summed).

`read_target` maps one checkpoint tensor's target (full-parameter coordinates, kvstate.families.
_weights.Target) to the rank's rows and columns and reads only those from the safetensors slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstate.config.plan import AttentionSpec, GatedDeltaNetSpec, KDASpec, Mamba1Spec, Mamba2Spec, MLASpec
from kvstate.parallel.plan import vocab_range


@dataclass(frozen=True)
class Cut:
    dim: int
    full: int  # the full parameter's size along dim
    ranges: tuple[tuple[int, int], ...]  # [start, stop) of the full parameter, in the rank's order

    def owned(self) -> list[int]:
        return [i for a, b in self.ranges for i in range(a, b)]


def _part(n: int, tp: int, rank: int, base: int = 0, unit: int = 1) -> tuple[int, int]:
    """Rank's share of n units of `unit` rows starting at `base`."""
    per = n // tp
    return base + rank * per * unit, base + (rank + 1) * per * unit


def _kv_heads(n: int, tp: int, rank: int) -> tuple[int, int]:
    """The KV heads a rank holds: n / tp of them, or the one its query heads use when n < tp."""
    if n % tp == 0:
        return rank * (n // tp), (rank + 1) * (n // tp)
    first = rank // (tp // n)
    return first, first + 1


def mixer_cuts(m, tp: int, r: int) -> tuple[dict[str, Cut], list[str]]:
    """(cuts by parameter name within the mixer, row-parallel biases)."""
    rows = lambda full, *ranges: Cut(0, full, ranges)  # noqa: E731
    cols = lambda full, *ranges: Cut(1, full, ranges)  # noqa: E731
    if isinstance(m, AttentionSpec):
        qd, d = m.head_dim * (2 if m.output_gate else 1), m.head_dim
        q = rows(m.num_heads * qd, _part(m.num_heads, tp, r, unit=qd))
        a, b = _kv_heads(m.num_kv_heads, tp, r)
        kv = rows(m.num_kv_heads * d, (a * d, b * d))
        o = cols(m.num_heads * d, _part(m.num_heads, tp, r, unit=d))
        cuts = {"q_proj.weight": q, "q_proj.bias": q, "k_proj.weight": kv, "k_proj.bias": kv, "v_proj.weight": kv,
                "v_proj.bias": kv, "o_proj.weight": o}
        return cuts, ["o_proj.bias"]
    if isinstance(m, MLASpec):
        qk, h = m.qk_nope_head_dim + m.qk_rope_head_dim, m.num_heads
        q = rows(h * qk, _part(h, tp, r, unit=qk))
        kvb = rows(h * (m.qk_nope_head_dim + m.v_head_dim), _part(h, tp, r, unit=m.qk_nope_head_dim + m.v_head_dim))
        o = cols(h * m.v_head_dim, _part(h, tp, r, unit=m.v_head_dim))
        return {"q_proj.weight": q, "q_b_proj.weight": q, "kv_b_proj.weight": kvb, "o_proj.weight": o}, ["o_proj.bias"]
    if isinstance(m, GatedDeltaNetSpec):
        hk, hv, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
        key, val = hk * dk, hv * dv
        conv = rows(2 * key + val, _part(hk, tp, r, 0, dk), _part(hk, tp, r, key, dk), _part(hv, tp, r, 2 * key, dv))
        heads = rows(hv, _part(hv, tp, r))
        return {"in_proj_qkv.weight": conv, "conv_weight": conv, "in_proj_z.weight": rows(val, _part(hv, tp, r, 0, dv)),
                "in_proj_b.weight": heads, "in_proj_a.weight": heads, "A_log": heads, "dt_bias": heads,
                "out_proj.weight": cols(val, _part(hv, tp, r, 0, dv))}, []
    if isinstance(m, KDASpec):
        h, d = m.num_heads, m.head_dim
        dim = h * d
        qkv = rows(3 * dim, *(_part(h, tp, r, p * dim, d) for p in range(3)))
        chan = rows(dim, _part(h, tp, r, 0, d))
        heads = rows(h, _part(h, tp, r))
        return {"qkv_proj.weight": qkv, "conv_weight": qkv, "f_b_proj.weight": chan, "A_log": heads, "dt_bias": chan,
                "b_proj.weight": heads, "g_b_proj.weight": chan, "o_proj.weight": cols(dim, _part(h, tp, r, 0, d))}, []
    if isinstance(m, Mamba2Spec):
        h, p, n, g = m.num_heads, m.head_dim, m.d_state, m.n_groups
        inner, gn = h * p, g * n
        ga, gb = _kv_heads(g, tp, r)  # the rank's B/C groups (one, replicated, when fewer than ranks)
        x = lambda base: _part(h, tp, r, base, p)  # noqa: E731
        bc = lambda base: (base + ga * n, base + gb * n)  # noqa: E731
        conv = rows(inner + 2 * gn, x(0), bc(inner), bc(inner + gn))
        proj = rows(2 * inner + 2 * gn + h, x(0), x(inner), bc(2 * inner), bc(2 * inner + gn),
                    _part(h, tp, r, 2 * inner + 2 * gn))
        heads = rows(h, _part(h, tp, r))
        return {"in_proj.weight": proj, "in_proj.bias": proj, "conv_weight": conv, "conv_bias": conv,
                "dt_bias": heads, "A_log": heads, "D": heads, "norm.weight": rows(inner, x(0)),
                "out_proj.weight": cols(inner, x(0))}, ["out_proj.bias"]
    if isinstance(m, Mamba1Spec):
        d = m.d_inner
        chan = rows(d, _part(d, tp, r))
        proj = rows(2 * d, _part(d, tp, r), _part(d, tp, r, d))
        return {"in_proj.weight": proj, "in_proj.bias": proj, "conv_weight": chan, "conv_bias": chan,
                "x_proj.weight": cols(d, _part(d, tp, r)), "dt_proj.weight": chan, "dt_proj.bias": chan,
                "A_log": chan, "D": chan, "out_proj.weight": cols(d, _part(d, tp, r))}, ["out_proj.bias"]
    raise ValueError(f"{m.kind} mixers are not sharded")


def _mlp_cuts(width: int, tp: int, r: int, prefix: str) -> tuple[dict[str, Cut], list[str]]:
    up = Cut(0, width, (_part(width, tp, r),))
    cuts = {f"{prefix}{n}.{w}": up for n in ("gate_proj", "up_proj") for w in ("weight", "bias")}
    cuts[f"{prefix}down_proj.weight"] = Cut(1, width, (_part(width, tp, r),))
    return cuts, [f"{prefix}down_proj.bias"]


def model_cuts(plan, tp: int, rank: int) -> tuple[dict[str, Cut], list[str]]:
    """(Cut of every sharded parameter of the full `plan`'s model, row-parallel biases) for rank `rank`."""
    start, stop = vocab_range(plan.vocab_size, tp, rank)
    vocab = Cut(0, plan.vocab_size, ((start, stop),))
    cuts, zero = {"embed_tokens.weight": vocab, "lm_head.weight": vocab}, []
    for layer in plan.layers:
        base = f"layers.{layer.index}."
        for m in layer.mixers:
            c, z = mixer_cuts(m, tp, rank)
            cuts.update({base + "mixer." + k: v for k, v in c.items()})
            zero += [base + "mixer." + k for k in z]
        f = layer.ffn
        parts = []
        if f.kind == "mlp":
            parts.append(_mlp_cuts(f.intermediate_size, tp, rank, base + "ffn."))
        elif f.kind == "moe":
            experts = Cut(0, f.num_experts, (_part(f.num_experts, tp, rank),))
            cuts[base + "ffn.experts.gate_up"] = cuts[base + "ffn.experts.down"] = experts
            zero.append(base + "ffn.fc2_latent_proj.bias")
            if f.shared_intermediate_size:
                parts.append(_mlp_cuts(f.shared_intermediate_size, tp, rank, base + "ffn.shared_experts."))
        for c, z in parts:
            cuts.update(c)
            zero += z
    return cuts, zero


# -- reading a target's share ------------------------------------------------------------------------


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of `idx` as [start, stop) pairs, in order."""
    out: list[list[int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, i + 1])
    return [(a, b) for a, b in out]


def read_rows(part, rows: list[int], cols: list[int] | None) -> torch.Tensor:
    """Rows (and columns) of a safetensors slice, read run by run (never the whole tensor)."""
    col_runs = None if cols is None else _runs(cols)
    pieces = []
    for a, b in _runs(rows):
        if col_runs is None:
            pieces.append(part[a:b])
        else:
            pieces.append(torch.cat([part[a:b, c:d] for c, d in col_runs], dim=1))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def read_target(part, shape: tuple[int, ...], target, cut: Cut):
    """(index into the rank's parameter, source tensor) for a checkpoint tensor (safetensors slice `part`
    of `shape`) whose `target` lands in a parameter cut by `cut`; None when the rank holds none of it."""
    local = {full: i for i, full in enumerate(cut.owned())}
    index, region_dim, coords = [], cut.dim, None
    for k, ix in enumerate(target.index):
        if k == cut.dim:
            if isinstance(ix, int):
                if ix not in local:
                    return None
                index.append(local[ix])
                region_dim = None
            else:
                coords = list(range(cut.full))[ix]
                index.append(None)  # filled below
            continue
        if k < cut.dim and isinstance(ix, int):
            region_dim -= 1
        index.append(ix)
    if region_dim is not None and coords is None:
        coords = list(range(cut.full))
        index += [slice(None)] * (cut.dim - len(index)) + [None]
    src_rows = list(range(shape[0]))
    if target.rows is not None:
        src_rows = list(target.rows) if isinstance(target.rows, tuple) else src_rows[target.rows]
    cols = None
    if region_dim is not None:
        js = [j for j, c in enumerate(coords) if c in local]
        if not js:
            return None
        mine = [local[coords[j]] for j in js]
        if mine != list(range(mine[0], mine[-1] + 1)):
            raise ValueError(f"{target.name}: the rank's share of a checkpoint tensor is not contiguous")
        index[cut.dim] = slice(mine[0], mine[-1] + 1)
        if region_dim == 0:
            src_rows = [src_rows[j] for j in js]
        elif region_dim == 1:
            cols = js
        else:
            raise ValueError(f"{target.name}: cut along dim {cut.dim} is not a row or column of the checkpoint tensor")
    return tuple(index), read_rows(part, src_rows, cols)
