"""Weight-only int8: each row of a projection as int8 with one fp32 scale, the math in fp32.

`quantize_rows(w)` is symmetric per output channel (W row): scale = max|row| / 127, q =
round(row / scale), so q * scale is within scale / 2 of every weight. The kernels widen q to
fp32 exactly, sum q[n, k] * x[k] in fp32 and multiply the sum by scale[n]; x is not quantized.
A quarter of fp32's bytes (half of bf16's) to stream per decode step, for a small logit error
that `kvstate bench engine --weight-dtype int8` measures against the fp32 model.

`quantize_linears(model)` does this to every `kernels.Linear` of a model (or stores GGML blocks,
`kernels.blocks`, with "q8_0", "q4_0", "q4_k"), except
- a weight shared with another module (a head tied to the embedding: the lookup needs the values),
- the projections a layer reads as a tensor rather than calls (listed in the layer class's
  `weight_read`: Mamba-1's dt_proj, MLA's kv_b_proj).
Other matrices (embeddings, MoE experts), and for blocks rows whose length is not a multiple of
the block (32 weights, 256 for q4_k), keep the dtype they have.
"""

from __future__ import annotations

import torch
from torch import nn

from kvstate.kernels.blocks import set_block_weight
from kvstate.kernels.ggml_blocks import TYPES
from kvstate.kernels.ggml_quantize import quantize
from kvstate.kernels.linear_module import Linear

QMAX = 127


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (q int8 [N, K], scale float32 [N]); an all-zero row gets scale 1."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(wf / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K], scale [N] -> float32 [N, K] (the weights the int8 kernels multiply by)."""
    return q.float() * scale[:, None]


def _shared(model: nn.Module) -> set[int]:
    """ids of parameters held by more than one module (tied tensors)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
    return {pid for pid, n in holders.items() if n > 1}


def _read_as_tensor(model: nn.Module) -> set[int]:
    """ids of the Linears whose layer reads `.weight` directly (its class's `weight_read`)."""
    out = set()
    for module in model.modules():
        for name in getattr(type(module), "weight_read", ()):
            child = getattr(module, name, None)
            if child is not None:
                out.add(id(child))
    return out


def eligible_linears(model: nn.Module) -> set[int]:
    """ids of the kernels.Linear modules whose weight may be stored quantized: not tied to another
    module, not read as a tensor by its layer, a float matrix now."""
    shared, skip = _shared(model), _read_as_tensor(model)
    return {id(m) for m in model.modules()
            if type(m) is Linear and id(m) not in skip and id(m.weight) not in shared
            and m.weight.dtype not in (torch.int8, torch.uint8) and m.weight.dim() == 2}


def quantize_linears(model: nn.Module, weight_dtype: str = "int8") -> int:
    """Store every eligible kernels.Linear weight as int8 + per-row scale ("int8"), or as GGML blocks
    ("q8_0", "q4_0", "q4_k"); -> how many."""
    qtype = None if weight_dtype == "int8" else weight_dtype.upper()
    eligible = eligible_linears(model)
    count = 0
    for module in model.modules():
        if id(module) not in eligible:
            continue
        if qtype is not None:
            if module.in_features % TYPES[qtype].block == 0:
                set_block_weight(module, quantize(module.weight, qtype), qtype)
                count += 1
            continue
        q, scale = quantize_rows(module.weight)
        module.weight = nn.Parameter(q, requires_grad=False)
        module.weight_scale = scale
        count += 1
    return count
