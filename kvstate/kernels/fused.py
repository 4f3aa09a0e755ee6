"""Several projections of the same input as one kernel call: `fuse(*linears)` and `project(x, *linears)`.

A batch-1 decode step pays for every call (Python dispatch, waking the threads, a barrier) as well
as for the weights it streams; GDN's four input projections, attention's q/k/v and the MLP's
gate/up each read the same x. `fuse` concatenates their weights once into one matrix and makes
each Linear's weight a row view of it (the same parameters and state dict, no second copy);
`project` then runs one `linear` and splits the columns. Unfused linears are called one by one,
so a layer's forward is the same code either way. Fuse after loading and after any dtype change:
a later `.to()` gives each Linear its own tensor again, and `project` then calls them apart.
"""

from __future__ import annotations

import torch
from torch import nn

from kvstate.kernels.blocks import block_linear, block_parts_linear
from kvstate.kernels.dispatch import linear


class FusedGroup:
    """The concatenated weight [sum N_i, K] (and bias, and int8 weights' per-row scale; GGML blocks
    [sum N_i, bytes per row]) of `members`, each a row view of it."""

    def __init__(self, members: tuple[nn.Linear, ...]):
        weights = [m.weight for m in members]
        self.members = members
        self.format = _format(members[0])  # GGML blocks: rows of blocks concatenate like rows of weights
        self.sizes = [w.shape[0] for w in weights]
        self.weight = torch.cat([w.detach() for w in weights])  # [sum N, K]
        self.bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
        scales = [_scale(m) for m in members]
        self.scale = None if scales[0] is None else torch.cat(scales)  # [sum N]
        scale_parts = self.scale.split(self.sizes) if self.scale is not None else [None] * len(self.sizes)
        for m, w, b, sc, old in zip(members, self.weight.split(self.sizes), self._bias_parts(), scale_parts, weights):
            m.weight = nn.Parameter(w, requires_grad=old.requires_grad)
            if b is not None:
                m.bias = nn.Parameter(b, requires_grad=m.bias.requires_grad)
            if sc is not None:
                m.weight_scale = sc

    def _bias_parts(self):
        return self.bias.split(self.sizes) if self.bias is not None else [None] * len(self.sizes)

    def intact(self) -> bool:
        """Every member still holds its view (no .to() or reassignment since)."""
        # a .to() or load replaces every member's tensor: the first one tells
        return self.members[0].weight.data_ptr() == self.weight.data_ptr()


class BlockParts:
    """Linears of one input whose weights are GGML blocks of different types (a Q4_K_M file keeps
    attention's v or GDN's qkv in Q6_K, the rest in Q4_K): rows of different widths cannot be one
    matrix, so each member keeps its own tensor and one compiled call (`blocks.block_parts_linear`)
    multiplies them all. `intact()` holds while every member holds the tensor it had at `remember()`."""

    parts = True
    bias = scale = None

    def __init__(self, members: tuple[nn.Linear, ...]):
        self.members = members
        self.format = tuple(_format(m) for m in members)
        self.sizes = [m.weight.shape[0] for m in members]
        self.remember()

    @property
    def weights(self) -> list[torch.Tensor]:
        return [m.weight for m in self.members]

    def remember(self) -> None:
        """Take the members' current tensors as the group's (after they moved, e.g. to huge pages)."""
        self._ptrs = [m.weight.data_ptr() for m in self.members]

    def intact(self) -> bool:
        return [m.weight.data_ptr() for m in self.members] == self._ptrs and \
            all(_format(m) == f for m, f in zip(self.members, self.format))


def _scale(m: nn.Linear) -> torch.Tensor | None:
    return getattr(m, "weight_scale", None)


def _format(m: nn.Linear) -> str | None:
    """The GGML block type a Linear's uint8 weight holds (`kernels.blocks`), else None."""
    return getattr(m, "weight_format", None)


def fuse(*linears: nn.Linear) -> FusedGroup | None:
    """Fuse linears of one input (same K, weight dtype and device, biases and scales all or none; GGML
    blocks of one type, or of several bias-free (`BlockParts`)); None if they differ."""
    first = linears[0]
    if any(getattr(m, "input_perm", None) is not None for m in linears):  # each reads x in its own order
        return None
    if any(_format(m) != _format(first) for m in linears):
        if any(_format(m) is None or m.bias is not None for m in linears):
            return None
        return _members_of(BlockParts(tuple(linears)))
    if any(m.weight.shape[1] != first.weight.shape[1] or m.weight.dtype != first.weight.dtype
           or m.weight.device != first.weight.device or (m.bias is None) != (first.bias is None)
           or (_scale(m) is None) != (_scale(first) is None) for m in linears):
        return None
    return _members_of(FusedGroup(tuple(linears)))


def _members_of(group):
    for m in group.members:
        m.fused_group = group  # a plain attribute: not a submodule, not in the state dict
    return group


def project(x: torch.Tensor, *linears: nn.Linear) -> list[torch.Tensor]:
    """[m(x) for m in linears], as one call when they were fused together (column views of one output)."""
    group = getattr(linears[0], "fused_group", None)
    # the fused matrix is a detached concat: under autograd (training) each member runs on its own
    training = torch.is_grad_enabled() and linears[0].weight.requires_grad
    if group is not None and not training and group.members == linears and group.intact():
        # split_with_sizes, not Tensor.split: no Python wrapper (called cold after every fused
        # projection: ~50 us less per call on the 0.5b model's machine, 48 calls a step)
        if getattr(group, "parts", False):
            y = block_parts_linear(x, group.weights, group.format)
        elif group.format is None:
            y = linear(x, group.weight, group.bias, group.scale)
        else:
            y = block_linear(x, group.weight, group.bias, group.format)
        return list(y.split_with_sizes(group.sizes, -1))
    return [m(x) for m in linears]
