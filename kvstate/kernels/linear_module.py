"""`Linear`: an nn.Linear whose weight may be stored in bf16 (or int8) while the math stays fp32.

A drop-in for the model layers (phase 2 of issue 9): same parameter names and state-dict keys
as nn.Linear, so checkpoints load unchanged; a bf16 checkpoint's weights are kept as they are
(half the bytes to stream per decode step) and widened exactly inside `kvstate.kernels.linear`.
`kernels.quant` may store the weight as int8 with a per-row `weight_scale` (a buffer, None
otherwise), or as GGML quantized blocks (`kernels.blocks`: `weight_format` names the block type).
"""

from __future__ import annotations

import torch
from torch import nn

from kvstate.kernels.blocks import block_linear, block_rows
from kvstate.kernels.dispatch import linear


class Linear(nn.Linear):
    """nn.Linear with `weight_dtype` (float32 or bfloat16) for the weight; bias and math in `dtype`."""

    weight_format: str | None = None  # a GGML block type ("Q4_K", ...) when the weight holds blocks
    # blocks whose columns are in another order than x's (a GGUF's reordered value heads, narrower than
    # a block): the forward reads x[..., input_perm] (int64 [K])
    input_perm: torch.Tensor | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 weight_dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.register_buffer("weight_scale", None)
        if weight_dtype is not None and weight_dtype != self.weight.dtype:
            self.weight = nn.Parameter(self.weight.detach().to(weight_dtype), requires_grad=self.weight.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_format is not None:
            if self.input_perm is not None:
                x = x.index_select(-1, self.input_perm)
            return block_linear(x, self.weight, self.bias, self.weight_format)
        return linear(x, self.weight, self.bias, self.weight_scale)

    @classmethod
    def from_linear(cls, module: nn.Linear, weight_dtype: torch.dtype | None = None) -> Linear:
        """A Linear sharing `module`'s parameters (the weight converted when `weight_dtype` differs)."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.in_features, out.out_features = module.in_features, module.out_features
        weight = module.weight
        if weight_dtype is not None and weight_dtype != weight.dtype:
            weight = nn.Parameter(weight.detach().to(weight_dtype), requires_grad=weight.requires_grad)
        out.weight = weight
        out.bias = module.bias
        out.register_buffer("weight_scale", getattr(module, "weight_scale", None))
        return out

    def extra_repr(self) -> str:
        scaled = ", per-row scales" if self.weight_scale is not None else ""
        return f"{super().extra_repr()}, weight_dtype={self.weight_format or self.weight.dtype}{scaled}"


class Embedding(nn.Embedding):
    """nn.Embedding whose table may be GGML blocks (a GGUF's token_embd kept as the file holds it:
    uint8 [vocab, bytes per row], `weight_format` its type): a lookup dequantizes only the rows it
    reads, exactly (fp32). A tied LM head holds the same blocks and multiplies by them."""

    weight_format: str | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight_format is None:
            return super().forward(ids)
        return block_rows(self.weight, ids, self.weight_format).reshape(*ids.shape, -1)
