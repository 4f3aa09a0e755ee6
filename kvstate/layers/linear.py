"""Linear layers whose decode-sized calls split the weight's rows over worker threads.

A decode step multiplies a few rows (one per sequence) by every weight matrix, so it streams the
weights from memory. torch's CPU GEMM parallelizes such thin products poorly: on the 2-core
development machine a [1, 1024] x [1024, 4096] product streamed 21 GB/s with 2 intra-op threads
and 28 GB/s as two single-threaded halves on two Python threads (torch releases the GIL); at 4 to
32 rows the split is 1.2x to 1.6x faster too. Larger inputs (prefill) are GEMM-bound and keep
torch's own threading. Workers come from `kvstate.ops._threads` (one pool for the whole process).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kvstate.ops import _threads

SMALL_ROWS = 64  # inputs with at most this many rows take the split path
MIN_WEIGHT = 1 << 20  # weights with fewer elements are not worth a thread hand-off


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), split over the output features for thin inputs on CPU."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows == 0 or rows > SMALL_ROWS or weight.numel() < MIN_WEIGHT or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    with _threads.plan(float("inf"), weight.shape[0]) as n:  # n = torch's thread count, 1 inside a worker
        if n < 2:
            return F.linear(x, weight, bias)
        parts = _threads.split(weight.shape[0], n)
        outs = _threads.run([partial(F.linear, x, weight[a:b], None if bias is None else bias[a:b])
                             for a, b in parts])
    return torch.cat(outs, dim=-1)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) with the thin-input split of `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
