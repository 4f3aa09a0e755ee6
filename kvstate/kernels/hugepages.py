"""Big tensors on transparent huge pages: the weights a decode step streams, and the state pools.

A batch-1 decode step streams every weight matrix once. With 4 KiB pages that is ~270,000 pages
per GiB, and the TLB misses of the walk cost bandwidth: the GEMV kernel streams the same bytes
faster from 2 MiB pages (docs/benchmarks.md, "Kernel history"). Linux backs an anonymous mapping with huge
pages when it is advised to (`madvise(MADV_HUGEPAGE)`: transparent huge pages in "madvise" or
"always" mode), so `arena(nbytes)` maps such a region and hands it out as a torch tensor, and
`place_weights(model)` moves the model's matrices into one (fused groups, tied tensors and the
parameters' identity kept: each moved parameter's `.data` is rebound). Where the OS offers no
huge pages (THP "never", not Linux), or `KVSTATE_HUGEPAGES=0`, nothing moves: same numbers, the
ordinary allocator.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
from pathlib import Path

import torch
from torch import nn

from kvstate.errors import KvstateError

HUGE = 2 << 20  # the x86-64 / arm64 transparent huge page
MIN_BYTES = 1 << 20  # smaller tensors stay where they are (a huge page each would waste memory)
ENV = "KVSTATE_HUGEPAGES"
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def unavailable_reason() -> str | None:
    """Why huge pages are not used here (None when they are)."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value in ("0", "no", "off", "false"):
        return f"turned off ({ENV}=0)"
    if value not in ("1", "yes", "on", "true", ""):
        raise KvstateError(f"{ENV}={value!r}: expected 1 or 0 (on or off)")
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "not Linux"
    try:
        mode = _THP.read_text()
    except OSError:
        return f"no {_THP}"
    if "[never]" in mode:
        return "transparent huge pages are off ([never])"
    return None


def arena(nbytes: int) -> torch.Tensor | None:
    """An uninitialised uint8 tensor of `nbytes` on memory advised for huge pages, its start 2 MiB
    aligned, or None where huge pages are unavailable. The tensor keeps its mapping alive."""
    if nbytes <= 0 or unavailable_reason() is not None:
        return None
    size = -(-nbytes // HUGE) * HUGE
    region = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # before any page is touched: faults then take 2 MiB pages
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping (its buffer export)
    start = -whole.data_ptr() % HUGE
    return whole[start : start + nbytes]


def zeros(layout: list[tuple[tuple[int, ...], torch.dtype]], align: int = 4096) -> list[torch.Tensor] | None:
    """Zero tensors of these (shape, dtype), packed one after the other (each `align`ed) into one
    arena, or None where huge pages are unavailable. A fresh mapping reads zeros, and its pages are
    only taken when first written."""
    offsets, end = [], 0
    for shape, dtype in layout:
        end = -(-end // align) * align
        offsets.append(end)
        end += _nbytes(shape, dtype)
    region = arena(end)
    if region is None:
        return None
    return [region[off : off + _nbytes(shape, dtype)].view(dtype).view(shape)
            for (shape, dtype), off in zip(layout, offsets)]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def place_weights(model: nn.Module, min_bytes: int = MIN_BYTES) -> int:
    """Move the model's big parameters (>= min_bytes, contiguous, on CPU) to huge pages; returns the
    bytes moved (0 where huge pages are unavailable). A fused projection group (`kernels.fused`) moves
    as its one matrix and its members become views of the new one, as before. One tensor at a time:
    each old tensor is released before the next is copied (the arena's pages are only taken as they
    are written), so the process never holds the weights twice."""
    groups, params, seen, parts = [], [], set(), {}
    for module in model.modules():
        group = getattr(module, "fused_group", None)
        if getattr(group, "parts", False):  # its members move as parameters; it then takes their new tensors
            parts[id(group)] = group
        elif group is not None and id(group) not in seen and group.intact():
            seen.add(id(group))
            seen.update(id(m.weight) for m in group.members)
            if group.weight.numel() * group.weight.element_size() >= min_bytes:
                groups.append(group)
    for param in model.parameters():  # unique: a tied head and embedding are one parameter
        if id(param) not in seen and param.is_cpu and param.is_contiguous() \
                and param.numel() * param.element_size() >= min_bytes:
            params.append(param)
    layout = [(tuple(t.shape), t.dtype) for t in [g.weight for g in groups] + [p.data for p in params]]
    slots = zeros(layout) if layout else None
    if slots is None:
        return 0
    with torch.no_grad():
        for group, new in zip(groups, slots):
            new.copy_(group.weight)
            group.weight = new
            for member, view in zip(group.members, new.split(group.sizes)):
                member.weight.data = view
        for param, new in zip(params, slots[len(groups):]):
            new.copy_(param.data)
            param.data = new
    for group in parts.values():
        group.remember()
    return sum(t.numel() * t.element_size() for t in slots)


def huge_bytes() -> int:
    """This process's anonymous memory on huge pages (AnonHugePages of /proc/self/smaps_rollup), or 0."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
