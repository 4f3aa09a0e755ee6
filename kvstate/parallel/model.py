"""A rank's shard of a checkpoint: its part of every parameter, read alone, and the collectives.

`load_shard(path, group)` builds the model of the rank's plan (`kvstate.parallel.plan`) on the
meta device, fills it from the checkpoint through the family's `weight_targets` (full-model
coordinates) and the rank's cuts (`kvstate.parallel.shard`: only its rows and columns are read
from each safetensors slice; replicated tensors whole), then `parallelize` adds what TP needs:
- one all-reduce of each block's mixer output (side-by-side mixers: of their sum) and FFN output
  (both end in a row-parallel projection or, for MoE, a sum over the rank's experts), and of the
  inner projections a mixer kind names as row-parallel (`tp_reduced`: Mamba-1's x_proj), as
  forward hooks: parameter names and layer classes stay as they are;
- a vocabulary-parallel embedding (each rank looks up its rows, zeros elsewhere, all-reduce) and
  LM head (each rank's logits columns, all-gathered into the full vocabulary);
- a grouped gated norm whose group spans several ranks (`tp_norm_group`: Mamba-2 with B/C groups
  fewer than ranks): the sums of squares are all-reduced per group.
The single-process model is untouched: none of this runs at TP 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from kvstate.errors import KvstateError
from kvstate.kernels.dispatch import linear
from kvstate.layers.moe import Experts
from kvstate.layers.norm import GatedRMSNorm
from kvstate.kernels.hugepages import place_weights
from kvstate.models.build import build_ffn, build_model, fuse_projections, set_weight_dtype
from kvstate.models.loader import copy_weight, checkpoint_weight_dtype, open_checkpoint, weight_dtype_of
from kvstate.parallel.comm import TPGroup
from kvstate.parallel.plan import shard_plan, vocab_range
from kvstate.parallel.shard import model_cuts, read_target


class VocabEmbedding(nn.Module):
    """The embedding rows [start, start + n) of the vocabulary; other ids look up zeros; summed over ranks."""

    def __init__(self, weight: nn.Parameter, start: int, group: TPGroup):
        super().__init__()
        self.weight, self.start, self.group = weight, start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # [T]
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, max(0, self.weight.shape[0] - 1)), self.weight).float()
        out = out * mine[:, None]  # [T, hidden]
        return self.group.all_reduce(out)


class GatheredHead(nn.Module):
    """The LM head's rows of this rank's vocabulary; the logits columns of every rank, gathered."""

    def __init__(self, weight: nn.Parameter, vocab: int, group: TPGroup):
        super().__init__()
        self.weight, self.vocab, self.group = weight, vocab, group
        self.per = -(-vocab // group.size)  # columns per rank (the last rank's padded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight).float()  # [M, n_local]
        if y.shape[1] < self.per:
            y = F.pad(y, (0, self.per - y.shape[1]))
        return torch.cat(self.group.all_gather(y.contiguous()), dim=-1)[:, : self.vocab]  # [M, vocab]


class SpanningGatedNorm(nn.Module):
    """Mamba-2's gate-then-norm over groups of `group_size` channels that span several ranks: each rank
    holds `weight.shape[0]` channels of group `group` of `num_groups`; the sums of squares are all-reduced."""

    def __init__(self, norm: GatedRMSNorm, group_size: int, group: int, num_groups: int, tp: TPGroup):
        super().__init__()
        self.weight, self.eps, self.act, self.gate_after = norm.weight, norm.eps, norm.act, norm.norm_before_gate
        self.group_size, self.group, self.num_groups, self.tp = group_size, group, num_groups, tp

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() if self.gate_after else x.float() * self.act(gate.float())  # [T, C_local]
        sums = x.new_zeros(x.shape[0], self.num_groups)
        sums[:, self.group] = x.pow(2).sum(-1)
        var = self.tp.all_reduce(sums)[:, self.group : self.group + 1] / self.group_size  # [T, 1]
        y = x * torch.rsqrt(var + self.eps) * self.weight.float()
        return (y * self.act(gate.float()) if self.gate_after else y).to(dtype)


class LocalExperts(Experts):
    """Experts [first, first + num_experts) of the full set: tokens routed elsewhere add nothing here."""

    def __init__(self, experts: Experts, first: int):
        nn.Module.__init__(self)
        self.num_experts, self.gated, self.act, self.first = experts.num_experts, experts.gated, experts.act, first
        self.gate_up, self.down = experts.gate_up, experts.down

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        local = ids.flatten() - self.first  # [T * k]
        slots = ((local >= 0) & (local < self.num_experts)).nonzero().flatten()  # token-slots routed here
        out = torch.zeros_like(x, dtype=torch.float32)
        if slots.numel() == 0:
            return out.to(x.dtype)
        ids_here, w_here = local[slots], weights.flatten()[slots]
        order = ids_here.argsort(stable=True)
        counts = torch.bincount(ids_here, minlength=self.num_experts).tolist()
        token_of = slots[order] // ids.shape[1]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tokens, w = token_of[start : start + n], w_here[order[start : start + n]]
            start += n
            h = linear(x[tokens], self.gate_up[e])
            if self.gated:
                g, u = h.chunk(2, dim=-1)
                h = self.act(g) * u
            else:
                h = self.act(h)
            out.index_add_(0, tokens, (linear(h, self.down[e]) * w[:, None]).float())
        return out.to(x.dtype)


def _local_experts(model: nn.Module, plan, opts, tp: int, rank: int) -> None:
    """MoE blocks of the rank's plan (built with its share of experts): the router back to all experts,
    the experts offset to the rank's first (on the meta device, before loading)."""
    for block, layer in zip(model.layers, plan.layers):
        if layer.ffn.kind == "moe":
            with torch.device("meta"):
                block.ffn.gate = build_ffn(layer.ffn, plan.hidden_size, opts).gate
            per = layer.ffn.num_experts // tp
            block.ffn.experts = LocalExperts(block.ffn.experts, rank * per)


def _reduce_hook(group: TPGroup):
    def hook(module, args, out):
        return group.all_reduce(out.contiguous())
    return hook


def parallelize(model: nn.Module, plan, group: TPGroup) -> nn.Module:
    """Add the collectives to a loaded shard of the full `plan` (see the module docstring)."""
    tp, rank = group.size, group.rank
    hook = _reduce_hook(group)
    for block, layer in zip(model.layers, plan.layers):
        for part in (block.mixer, block.ffn):
            if part is not None:
                part.register_forward_hook(hook)
        for spec, mixer in zip(layer.mixers, block.mixer_modules()):
            for name in spec.tp_reduced:
                getattr(mixer, name).register_forward_hook(hook)
            spanning = spec.tp_norm_group(tp, rank)
            if spanning is not None:
                mixer.norm = SpanningGatedNorm(mixer.norm, *spanning, group)
    start, _ = vocab_range(plan.vocab_size, tp, rank)
    model.embed_tokens = VocabEmbedding(model.embed_tokens.weight, start, group)
    model.lm_head = GatheredHead(model.lm_head.weight, plan.vocab_size, group)
    model.tp_group = group
    return model


def check_weight_dtype(weight_dtype) -> None:
    """Quantized weights (int8, GGML blocks) are one process's: refused before any rank starts."""
    if weight_dtype_of(weight_dtype) in (torch.int8, torch.uint8):
        name = str(weight_dtype).removeprefix("torch.").lower()
        raise KvstateError(f"{name} weights run in one process: tensor parallelism shards bf16 or fp32 weights")


def load_shard(path, group: TPGroup, *, weight_dtype=None):
    """-> (rank's model in eval mode, full plan). Reads only the rank's part of each sharded tensor."""
    path, plan, family, opts, files = open_checkpoint(path)
    check_weight_dtype(weight_dtype)
    local = shard_plan(plan, group.size, group.rank)
    model = build_model(local, opts, device="meta")
    _local_experts(model, plan, opts, group.size, group.rank)
    set_weight_dtype(model, weight_dtype_of(weight_dtype) or checkpoint_weight_dtype(files))
    model.to_empty(device="cpu")
    if plan.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters())
    params.update(model.named_buffers())
    filled = {name: 0 for name in params}
    cuts, zero = model_cuts(plan, group.size, group.rank)
    for file in files:
        _fill(file, family, plan, cuts, params, filled)
    if plan.tie_word_embeddings:
        filled.pop("lm_head.weight", None)
    missing = [n for n, count in filled.items() if count < params[n].numel()]
    if missing:
        raise KvstateError(f"{path}: checkpoint is missing tensors for {', '.join(missing[:5])}")
    if group.rank != 0:  # row-parallel biases: added once, by rank 0 (the outputs are summed)
        with torch.no_grad():
            for name in zero:
                if name in params:
                    params[name].zero_()
    fuse_projections(model)
    place_weights(model)  # the streamed matrices on huge pages, as load_model puts them
    parallelize(model, plan, group)
    model.eval()
    model.hf_config = json.loads((Path(path) / "config.json").read_text())
    return model, plan


def _fill(file: Path, family, plan, cuts, params, filled) -> None:
    try:
        f = safe_open(str(file), framework="pt")
    except Exception as exc:
        raise KvstateError(f"{file}: not a valid safetensors file ({str(exc).splitlines()[0][:120]})") from None
    with f:
        for key in f.keys():
            targets = family.weight_targets(key, plan)
            if targets is None:
                raise KvstateError(f"{file.name}: tensor {key!r} is not part of a {plan.model_type} model")
            part, whole = f.get_slice(key), None
            for t in targets:
                if t.name not in params:
                    raise KvstateError(f"{file.name}: tensor {key!r} maps to {t.name!r}, "
                                       "which this model does not have")
                cut = cuts.get(t.name)
                if cut is None:  # replicated: the whole tensor (read once for all its targets)
                    whole = f.get_tensor(key) if whole is None else whole
                    copy_weight(params, filled, t, whole, key, file.name, plan)
                    continue
                shape = tuple(part.get_shape())
                if not t.index and t.rows is None and (len(shape) <= cut.dim or shape[cut.dim] != cut.full):
                    # a small tensor stored in another layout (e.g. A_log [1, 1, H, 1] for [H]): whole, reshaped
                    whole = f.get_tensor(key) if whole is None else whole
                    full = list(params[t.name].shape)
                    full[cut.dim] = cut.full
                    src = whole.reshape(full).index_select(cut.dim, torch.tensor(cut.owned()))
                    got = (), src
                else:
                    got = read_target(part, shape, t, cut)
                if got is None:
                    continue
                index, src = got
                view = params[t.name][index]
                if src.numel() != view.numel():
                    raise KvstateError(f"{file.name}: tensor {key!r} gives {tuple(src.shape)} for {t.name}"
                                       f"{list(index)}, expected {tuple(view.shape)}")
                with torch.no_grad():
                    view.copy_(src.reshape(view.shape))
                filled[t.name] += view.numel()
