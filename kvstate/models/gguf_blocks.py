"""Which projections of a model keep a GGUF file's quantized blocks, decided from the file's headers.

A projection (`kernels.Linear`) holds blocks (`kernels.blocks.set_block_weight`) when every tensor
that fills it is a matrix of one block type kvstate multiplies (`SUPPORTED`) and lands on whole rows
of its weight: rows are runs of whole blocks, so tensors concatenated along rows (q/k/v into one
weight, one fused tensor split into two) concatenate or split as blocks too. Everything else is
dequantized to bf16 and the load says so in one line: other types (Q2_K, Q3_K, IQ2_XS, ...), a weight
that mixes types or takes part float tensors, and the projections a layer reads as a tensor
(`weight_read`). The embedding table keeps its blocks too (`kernels.Embedding` dequantizes the rows
it looks up), and a tied LM head multiplies by the same blocks. MoE expert
tensors [E, N, K] keep their blocks the same way in the `Experts` parameters they fill (gate and
up of one type, since they share one parameter), each expert's rows multiplied by `block_linear`.

The decision is made on the meta model before its memory exists, so the bf16 copy of a kept
matrix is never allocated: `plan_blocks` picks, `to_meta_blocks` gives each chosen Linear a uint8
weight of the blocks' shape, the loader copies the file's rows into it, and `finish_blocks` marks
each Linear's block type once it is filled.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from kvstate.gguf.weights import input_order, tensor_types
from kvstate.kernels import Embedding
from kvstate.kernels.blocks import SUPPORTED, set_block_weight
from kvstate.kernels.ggml_blocks import row_bytes
from kvstate.kernels.quant import eligible_linears
from kvstate.layers.moe import Experts

FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass
class BlockPlan:
    linears: dict[str, str] = field(default_factory=dict)  # module name -> GGML type it holds
    blocks: frozenset[str] = frozenset()  # GGUF tensors read as blocks (some target holds them)
    kept: frozenset[str] = frozenset()  # GGUF tensors all of whose targets hold them as blocks
    dequantized: Counter = field(default_factory=Counter)  # GGML type -> quantized tensors dequantized
    input_orders: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> `Linear.input_perm`
    experts: dict[str, str] = field(default_factory=dict)  # `Experts` parameter -> GGML type it holds
    embedding: str | None = None  # the GGML type the embedding table (and a tied head) holds


def plan_blocks(model: nn.Module, reader, cfg: dict, targets_of, keep: bool = True) -> BlockPlan:
    """The projections of `model` (on meta) that hold the blocks of the GGUF file open in `reader` as they
    are (none without `keep`: every quantized tensor is then dequantized)."""
    ids = eligible_linears(model)
    eligible = {name: m for name, m in model.named_modules() if id(m) in ids}
    sources: dict[str, set[str | None]] = {}  # our parameter -> the block types filling it (None: any other)
    quantized: dict[str, tuple[str, list[str]]] = {}  # GGUF name -> (type, our parameters it fills)
    orders: dict[str, torch.Tensor] = {}  # our projection -> the order it reads its input in (blocks only)
    for gguf_name, name, qtype, shape in tensor_types(reader, cfg):
        whole = keep and len(shape) == 2 and qtype in SUPPORTED
        if "{e}" in name:  # MoE experts [E, N, K]: every expert's rows of one fused parameter
            params = _expert_params(model, name, shape, targets_of)
            for p in params:
                sources.setdefault(p, set()).add(qtype if keep and qtype in SUPPORTED else None)
            if qtype not in FLOAT_TYPES:
                quantized[gguf_name] = (qtype, params)
            continue
        params = []
        for target in targets_of(name) or []:
            if target.name == "embed_tokens.weight":  # the table (and a tied head) as blocks: whole rows
                ok = whole and not target.index and isinstance(model.embed_tokens, Embedding)
                sources.setdefault(target.name, set()).add(qtype if ok else None)
                params.append(target.name)
                continue
            module = target.name.removesuffix(".weight")
            rows_only = len(target.index) <= 1 and all(isinstance(i, slice) for i in target.index)
            ok = (whole and rows_only and module in eligible and target.name == f"{module}.weight"
                  and eligible[module].in_features == shape[1])
            sources.setdefault(target.name, set()).add(qtype if ok else None)
            params.append(target.name)
        if qtype not in FLOAT_TYPES:
            quantized[gguf_name] = (qtype, params)
            if whole and (order := input_order(name, cfg, qtype)) is not None:
                orders.update({p.removesuffix(".weight"): order for p in params})
    plan = BlockPlan()
    whole_kinds = {p: next(iter(kinds)) for p, kinds in sources.items() if len(kinds) == 1 and None not in kinds}
    plan.embedding = whole_kinds.pop("embed_tokens.weight", None)
    plan.linears = {p.removesuffix(".weight"): q for p, q in whole_kinds.items() if p.endswith(".weight")}
    plan.experts = {p: q for p, q in whole_kinds.items() if not p.endswith(".weight")}
    held = {f"{m}.weight" for m in plan.linears} | set(plan.experts)
    if plan.embedding:
        held.add("embed_tokens.weight")
    plan.blocks = frozenset(t for t, (_, params) in quantized.items() if any(p in held for p in params))
    kept = {t for t, (_, params) in quantized.items() if params and all(p in held for p in params)}
    plan.kept = frozenset(kept)
    plan.dequantized = Counter(q for t, (q, _) in quantized.items() if t not in kept)
    plan.input_orders = {m: o for m, o in orders.items() if m in plan.linears}
    return plan


def _expert_params(model: nn.Module, name: str, shape: tuple[int, ...], targets_of) -> list[str]:
    """The `Experts` parameters (gate_up, down) an expert tensor pattern [E, N, K] fills, when each is
    filled by whole rows of each expert (its own K); [] otherwise (then it is dequantized)."""
    params = []
    for target in targets_of(name.format(e=0)) or []:
        owner, _, attr = target.name.rpartition(".")
        module = model.get_submodule(owner) if owner else None
        rows = target.index[1:]
        if not isinstance(module, Experts) or attr not in ("gate_up", "down") or len(shape) != 3 \
                or getattr(module, attr).shape[-1] != shape[-1] or not all(isinstance(i, slice) for i in rows):
            return []
        params.append(target.name)
    return params


def to_meta_blocks(model: nn.Module, plan: BlockPlan) -> None:
    """Each chosen Linear's weight becomes a (meta) uint8 [N, bytes per row] tensor for the file's rows;
    each chosen `Experts` parameter [E, N, K] a uint8 [E, N, bytes per row] one."""
    for name, qtype in plan.linears.items():
        m = model.get_submodule(name)
        shape = (m.out_features, row_bytes(qtype, m.in_features))
        m.weight = nn.Parameter(torch.empty(shape, dtype=torch.uint8, device="meta"), requires_grad=False)
    if plan.embedding:
        table = model.embed_tokens
        shape = (table.num_embeddings, row_bytes(plan.embedding, table.embedding_dim))
        table.weight = nn.Parameter(torch.empty(shape, dtype=torch.uint8, device="meta"), requires_grad=False)
    for name, qtype in plan.experts.items():
        owner, _, attr = name.rpartition(".")
        m = model.get_submodule(owner)
        e, n, k = getattr(m, attr).shape
        setattr(m, attr, nn.Parameter(torch.empty(e, n, row_bytes(qtype, k), dtype=torch.uint8, device="meta"),
                                      requires_grad=False))


def finish_blocks(model: nn.Module, plan: BlockPlan) -> None:
    """Mark each filled Linear as holding its blocks (`set_block_weight` checks the shape once more)."""
    for name, qtype in plan.linears.items():
        m = model.get_submodule(name)
        set_block_weight(m, m.weight.data, qtype)
        if name in plan.input_orders:  # its blocks keep the file's column order (`gguf.weights.input_order`)
            m.input_perm = plan.input_orders[name]
    for name, qtype in plan.experts.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), f"{attr}_format", qtype)  # Experts.gate_up_format / down_format
    if plan.embedding:
        table = model.embed_tokens
        table.weight_format = plan.embedding
        if model.lm_head.weight is table.weight:  # tied: the head multiplies by the same blocks
            set_block_weight(model.lm_head, table.weight.data, plan.embedding)
            model.lm_head.weight = table.weight


def dequantized_line(file, plan: BlockPlan, dtype: torch.dtype) -> str | None:
    """One line naming the quantized tensors the load dequantized (None when every one stayed blocks)."""
    if not plan.dequantized:
        return None
    kinds = ", ".join(f"{n} {q}" for q, n in sorted(plan.dequantized.items()))
    kept = sorted(set(plan.linears.values()))
    held = f"; {len(plan.linears)} projections keep their blocks ({', '.join(kept)})" if kept else ""
    return f"{file}: {kinds} tensor(s) dequantized to {str(dtype).removeprefix('torch.')} at load{held}"
