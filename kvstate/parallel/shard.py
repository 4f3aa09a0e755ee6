"""Which part of every full parameter a rank holds, and the loader that reads only that part.

A `Cut` (kvstate.config.cuts) says: along dimension `dim` the rank's parameter is these ranges of
the full one, in order. Each mixer kind gives its own cuts (`tp_cuts`, kvstate.config.mixers);
here: the MLP's (gate/up along dim 0, down along dim 1), the routed experts along their expert
dimension, and the embedding and LM head rows. Parameters without a Cut are replicated; the biases
of row-parallel projections are kept on rank 0 and zero elsewhere (their outputs are summed).

`read_target` maps one checkpoint tensor's target (full-parameter coordinates, kvstate.families.
_weights.Target) to the rank's rows and columns and reads only those from the safetensors slice.
"""

from __future__ import annotations

import torch

from kvstate.config.cuts import Cut, part
from kvstate.parallel.plan import vocab_range


def _mlp_cuts(width: int, tp: int, r: int, prefix: str) -> tuple[dict[str, Cut], list[str]]:
    up = Cut(0, width, (part(width, tp, r),))
    cuts = {f"{prefix}{n}.{w}": up for n in ("gate_proj", "up_proj") for w in ("weight", "bias")}
    cuts[f"{prefix}down_proj.weight"] = Cut(1, width, (part(width, tp, r),))
    return cuts, [f"{prefix}down_proj.bias"]


def model_cuts(plan, tp: int, rank: int) -> tuple[dict[str, Cut], list[str]]:
    """(Cut of every sharded parameter of the full `plan`'s model, row-parallel biases) for rank `rank`."""
    start, stop = vocab_range(plan.vocab_size, tp, rank)
    vocab = Cut(0, plan.vocab_size, ((start, stop),))
    cuts, zero = {"embed_tokens.weight": vocab, "lm_head.weight": vocab}, []
    for layer in plan.layers:
        base = f"layers.{layer.index}."
        for name, m in zip(layer.mixer_names, layer.mixers):
            c, z = m.tp_cuts(tp, rank)
            cuts.update({f"{base}{name}.{k}": v for k, v in c.items()})
            zero += [f"{base}{name}.{k}" for k in z]
        f = layer.ffn
        parts = []
        if f.kind == "mlp":
            parts.append(_mlp_cuts(f.intermediate_size, tp, rank, base + "ffn."))
        elif f.kind == "moe":
            experts = Cut(0, f.num_experts, (part(f.num_experts, tp, rank),))
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
