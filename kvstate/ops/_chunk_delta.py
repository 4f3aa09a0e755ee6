"""Shared internals of the delta-family ops: argument checks, flattening, and the chunk layout.

Every op here sees a batch as flat tokens: q, k [tot, H, K], v [tot, HV, V], g, beta [tot, HV],
plus the list of sequence lengths (a [B, T] batch is B sequences of T tokens; a packed batch is
cut by `cu_seqlens`). The chunk forms then cut every sequence into chunks of C tokens and lay the
chunks out *step-major*: step j holds chunk j of every sequence that has one, sequences sorted by
decreasing length, so the sequences still running at step j are always a prefix (like PyTorch's
PackedSequence). The sequential scan over chunks then works on contiguous slices, whatever the
mix of lengths, and never computes padding chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial

import torch

from kvstate.ops import _threads
from kvstate.ops._common import check, check_cu_seqlens, check_qkv, l2norm


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 when the inputs are fp64 (used by gradient checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Batch:
    """Validated inputs, flattened to tokens. See the module docstring for the shapes."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor | None
    beta: torch.Tensor | None
    lens: list[int]  # tokens per sequence
    starts: list[int]  # first token of each sequence in the flat layout
    out_shape: tuple[int, ...]  # [B, T, HV, V] of the output
    scale: float
    s0: torch.Tensor | None  # initial_state as given: [N, HV, K, V] (or a pool [P, ...]), None = zeros
    dtype: torch.dtype  # input dtype: outputs come back in it
    acc: torch.dtype

    @property
    def n_seq(self) -> int:
        return len(self.lens)

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(H, HV, K, V)."""
        return self.q.shape[1], self.v.shape[1], self.q.shape[2], self.v.shape[2]


def prepare(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, needs_beta: bool, pool: bool = False) -> Batch:
    """Check the contract's shapes (ValueError naming the argument) and flatten to tokens.

    `pool`: `initial_state` is a state pool indexed by `state_indices` (recurrent forms), so its
    number of rows is free; otherwise it has one row per sequence.
    """
    b, t, h, dk, hv, dv = check_qkv(q, k, v)
    if g is not None:
        check("g", g, shape=(b, t, hv))
    if needs_beta or beta is not None:
        check("beta", beta, shape=(b, t, hv))
    check_cu_seqlens(cu_seqlens, b, t)
    if cu_seqlens is None:
        lens, starts = [t] * b, [i * t for i in range(b)]
    else:
        bounds = cu_seqlens.tolist()
        lens, starts = [e - s for s, e in zip(bounds[:-1], bounds[1:])], bounds[:-1]
    acc = acc_dtype(q.dtype)
    s0 = None
    if initial_state is not None:
        check("initial_state", initial_state, shape=(None if pool else len(lens), hv, dk, dv))
        s0 = initial_state
    scale = dk**-0.5 if scale is None else float(scale)
    flat = lambda x: None if x is None else x.reshape(b * t, *x.shape[2:])  # noqa: E731
    return Batch(flat(q), flat(k), flat(v), flat(g), flat(beta), lens, starts, (b, t, hv, dv), scale,
                 s0, q.dtype, acc)


def normalize_qk(q: torch.Tensor, k: torch.Tensor, acc: torch.dtype, l2: bool,
                 inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast to the accumulation dtype and optionally L2-normalize (eps 1e-6, as fla/transformers).

    `inplace` scales tensors the caller owns (fresh gathers, no autograd) without a copy.
    """
    q, k = q.to(acc), k.to(acc)
    if not l2:
        return q, k
    if not inplace:
        return l2norm(q), l2norm(k)
    for x in (q, k):
        x.mul_(torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().add_(1e-6)))
    return q, k


@dataclass
class Layout:
    """Step-major chunk layout of a batch of sequences (see the module docstring)."""

    chunk: int
    steps: list[tuple[int, int]]  # per step j: (first slot, number of sequences still running)
    order: torch.Tensor  # rank -> sequence index (ranks sorted by decreasing length)
    identity: bool  # order is 0..N-1
    tok: torch.Tensor  # [slots, C] flat token index of each (slot, position); padding -> 0
    pad_slots: set[int]  # slots whose chunk is not full (padding positions must be zeroed)
    valid: torch.Tensor  # [slots, C] bool, False at padding positions
    slot_of_tok: torch.Tensor  # [tot] slot holding each token
    pos_of_tok: torch.Tensor  # [tot] position of each token inside its chunk
    runs: dict = field(default_factory=dict)  # (s0, s1) -> first token of a contiguous run, or None

    @property
    def slots(self) -> int:
        return self.tok.shape[0]


def make_layout(lens: list[int], starts: list[int], chunk: int, device: torch.device) -> Layout:
    long = dict(dtype=torch.long, device=device)
    lens_t, starts_t = torch.tensor(lens, **long), torch.tensor(starts, **long)
    n_chunks = (lens_t + chunk - 1) // chunk  # [N]
    order = torch.argsort(-n_chunks, stable=True)  # rank -> sequence
    rank = torch.empty_like(order).index_copy_(0, order, torch.arange(len(lens), **long))
    n_steps = int(n_chunks.max()) if len(lens) else 0
    active = (n_chunks[order][None, :] > torch.arange(n_steps, **long)[:, None]).sum(1)  # [J] running per step
    first = torch.cumsum(active, 0) - active  # [J] first slot of each step
    steps = list(zip(first.tolist(), active.tolist()))
    step_of_slot = torch.repeat_interleave(torch.arange(n_steps, **long), active)  # [S]
    seq = order[torch.arange(step_of_slot.numel(), **long) - first[step_of_slot]]  # [S] sequence of each slot
    pos = step_of_slot[:, None] * chunk + torch.arange(chunk, **long)  # [S, C] position inside its sequence
    valid = pos < lens_t[seq][:, None]
    tok = torch.where(valid, starts_t[seq][:, None] + pos, 0)
    pad_slots = set(torch.nonzero(~valid.all(1)).flatten().tolist())
    seq_of_tok = torch.repeat_interleave(torch.arange(len(lens), **long), lens_t)  # [tot]
    p = torch.arange(seq_of_tok.numel(), **long) - starts_t[seq_of_tok]  # position inside its sequence
    slot_of_tok = first[p // chunk] + rank[seq_of_tok] if n_steps else p
    identity = bool((order == torch.arange(len(lens), **long)).all())
    return Layout(chunk, steps, order, identity, tok, pad_slots, valid, slot_of_tok, p % chunk)


def _run_start(lay: Layout, s0: int, s1: int) -> int | None:
    """First token if slots s0..s1 cover one contiguous token range without padding, else None."""
    key = (s0, s1)
    if key not in lay.runs:
        tok = lay.tok[s0:s1].flatten()
        t0 = int(tok[0]) if tok.numel() else 0
        ok = not any(s in lay.pad_slots for s in range(s0, s1)) and bool(
            (tok == torch.arange(t0, t0 + tok.numel(), device=tok.device)).all())
        lay.runs[key] = t0 if ok else None
    return lay.runs[key]


def gather(x: torch.Tensor, lay: Layout, s0: int, s1: int, dtype: torch.dtype) -> torch.Tensor:
    """Tokens [tot, H, *D] -> chunks [s1 - s0, H, C, *D] of slots s0..s1, padding zeroed."""
    n, c = s1 - s0, lay.chunk
    t0 = _run_start(lay, s0, s1)
    xs = x[t0:t0 + n * c] if t0 is not None else x.index_select(0, lay.tok[s0:s1].flatten())
    # always a fresh tensor (callers may scale it in place), even when the transpose is a no-op
    out = xs.view(n, c, *x.shape[1:]).transpose(1, 2).to(dtype, copy=True, memory_format=torch.contiguous_format)
    if any(s in lay.pad_slots for s in range(s0, s1)):
        mask = lay.valid[s0:s1][:, None, :]
        out = out * mask.reshape(*mask.shape, *([1] * (out.dim() - 3))).to(dtype)
    return out


def scatter_(out: torch.Tensor, y: torch.Tensor, lay: Layout, s0: int) -> None:
    """Write chunks y [n, HV, C, V] of slots s0.. into the token output out [tot, HV, V] (in place)."""
    n, c = y.shape[0], lay.chunk
    t0 = _run_start(lay, s0, s0 + n)
    yt = y.transpose(1, 2)  # [n, C, HV, V]
    if t0 is not None:
        out[t0:t0 + n * c].view(n, c, *out.shape[1:]).copy_(yt)
    else:
        valid = lay.valid[s0:s0 + n]
        out[lay.tok[s0:s0 + n][valid]] = yt[valid].to(out.dtype)


def unchunk(y: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Chunks y [slots, HV, C, V] -> tokens [tot, HV, V] (differentiable)."""
    heads = torch.arange(y.shape[1], device=y.device)
    return y[lay.slot_of_tok[:, None], heads[None, :], lay.pos_of_tok[:, None]]


def decay_mask(b: torch.Tensor) -> torch.Tensor:
    """exp(b_i - b_j) for j <= i, 0 above the diagonal: b [..., C] cumulative log decay -> [..., C, C].

    Only non-positive differences are exponentiated (-inf above the diagonal), so huge decays
    underflow to 0 instead of overflowing. In-place after the first op (autograd-safe).
    """
    c = b.shape[-1]
    upper = torch.ones(c, c, dtype=torch.bool, device=b.device).triu(1)
    return (b[..., :, None] - b[..., None, :]).masked_fill_(upper, float("-inf")).exp_()


def sorted_initial(batch: Batch, lay: Layout, shape: tuple[int, ...]) -> torch.Tensor:
    """Initial states in rank order [N, HV, K, V] (zeros when none was given)."""
    if batch.s0 is None:
        return torch.zeros(batch.n_seq, *shape, dtype=batch.acc, device=batch.q.device)
    s0 = batch.s0.to(batch.acc)
    return s0 if lay.identity else s0[lay.order]


def unsort_final(final: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Rank order -> sequence order."""
    if lay.identity:
        return final
    return torch.empty_like(final).index_copy(0, lay.order, final)


def needs_grad(*xs) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


def blocks(lay: Layout, per_slot_bytes: int, budget: int):
    """Split the steps into blocks of about `budget` bytes of [slots, ...] temporaries.

    Yields (first slot, end slot, [(slot offset, active, active at the next step), ...]).
    """
    block, start = [], 0
    for j, (off, m) in enumerate(lay.steps):
        m_next = lay.steps[j + 1][1] if j + 1 < len(lay.steps) else 0
        block.append((off, m, m_next))
        if (off + m - start) * per_slot_bytes >= budget:
            yield start, off + m, block
            block, start = [], off + m
    if block:
        yield start, block[-1][0] + block[-1][1], block


class Carry:
    """The state carried across chunks, in rank order, for one chunked call.

    Inference (grad=False): one buffer [N, HV, K, V], each step updates the rows of the sequences
    still running in place; rows of finished sequences keep their final state. Training
    (grad=True): out-of-place, so that autograd sees a plain graph.
    """

    def __init__(self, init: torch.Tensor, lay: Layout, grad: bool, dst: torch.Tensor | None = None):
        self.grad, self.init = grad, init
        self.m0 = lay.steps[0][1] if lay.steps else 0
        if grad:
            self.buf = None
        elif dst is not None and lay.identity and dst.is_contiguous():
            # carry the state in the caller's final-state buffer (a worker's head slice of it is not
            # contiguous across sequences: that one is carried in a copy and written back at the end)
            self.buf = dst.copy_(init)
        else:
            self.buf = init.clone()
        self.cur = init[: self.m0]  # grad mode: states of the ranks still running
        self.finished: list[torch.Tensor] = []

    def run(self, s0: int, steps, step) -> None:
        """Run one block's steps: step(r, m, state [m, HV, K, V]) handles block rows r..r+m.

        In inference mode `step` updates `state` in place; in grad mode it returns the new state.
        """
        for off, m, m_next in steps:
            if self.grad:
                new = step(off - s0, m, self.cur)
                self.finished.append(new[m_next:])
                self.cur = new[:m_next]
            else:
                step(off - s0, m, self.buf[:m])

    def final(self) -> torch.Tensor:
        """Final states in rank order."""
        if not self.grad:
            return self.buf
        return torch.cat(self.finished[::-1] + [self.init[self.m0:]])  # ranks finish in decreasing order


class Output:
    """Where each step's chunk outputs go: straight into the token-major result when the step is
    one full chunk of contiguous tokens (a strided bmm output costs nothing extra), else through
    a small buffer scattered by token index. In grad mode the pieces are concatenated at the end.
    """

    def __init__(self, lay: Layout, tot: int, hv: int, dv: int, dtype: torch.dtype, acc: torch.dtype, device,
                 grad: bool, dst: torch.Tensor | None = None):
        self.lay, self.grad, self.hv, self.dv, self.acc = lay, grad, hv, dv, acc
        if grad:
            self.out = None
        else:
            self.out = dst if dst is not None else torch.empty(tot, hv, dv, dtype=dtype, device=device)
        self.pieces: list[torch.Tensor] = []

    def target(self, slot: int, m: int) -> torch.Tensor | None:
        """A writable [m * HV, C, V] view of the result for slots slot..slot+m, or None."""
        if self.grad or self.out.dtype != self.acc:
            return None
        t0 = _run_start(self.lay, slot, slot + m) if m == 1 else None
        if t0 is None:
            return None
        return self.out[t0:t0 + self.lay.chunk].transpose(0, 1)  # [HV, C, V], strides (V, HV V, 1)

    def put(self, slot: int, o: torch.Tensor) -> None:
        """Store chunk outputs o [m, HV, C, V] computed outside a target view."""
        if self.grad:
            self.pieces.append(o)
        else:
            scatter_(self.out, o, self.lay, slot)

    def result(self) -> torch.Tensor:
        """Token outputs [tot, HV, V]."""
        if not self.grad:
            return self.out
        if not self.pieces:
            return torch.zeros(0, self.hv, self.dv, dtype=self.acc)
        return unchunk(torch.cat(self.pieces), self.lay)


def split_heads(batch: Batch, h0: int, h1: int) -> Batch:
    """The part of the batch with key heads h0..h1 and their value heads (views, no copies)."""
    grp = batch.dims[1] // batch.dims[0]
    hv = slice(h0 * grp, h1 * grp)
    cut = lambda x: None if x is None else x[:, hv]  # noqa: E731
    return replace(batch, q=batch.q[:, h0:h1], k=batch.k[:, h0:h1], v=batch.v[:, hv], g=cut(batch.g),
                   beta=cut(batch.beta), s0=cut(batch.s0), out_shape=(*batch.out_shape[:2], (h1 - h0) * grp,
                                                                       batch.out_shape[3]))


def run_split(batch: Batch, kernel, *, output_final_state: bool, grad: bool):
    """Run kernel(batch, o_dst, s_dst, output_final_state) -> (o [tot, HV, V], final or None), in
    parallel over key-head groups when the call is big enough (kvstate/ops/_threads.py).

    Returns (o [B, T, HV, V] in the input dtype, final_state [N, HV, K, V] or None).
    """
    h, hv, dk, dv = batch.dims
    with _threads.plan(batch.q.shape[0] * hv * dk * dv, h, serial=not grad) as n_work:
        if n_work == 1:
            o, final = kernel(batch, None, None, output_final_state)
            return o.to(batch.dtype).view(batch.out_shape), final
        grp, dev = hv // h, batch.q.device
        o = torch.empty(batch.q.shape[0], hv, dv, dtype=batch.dtype, device=dev)
        final = torch.empty(batch.n_seq, hv, dk, dv, dtype=batch.acc, device=dev) if output_final_state else None
        _threads.run([partial(kernel, split_heads(batch, a, b), o[:, a * grp:b * grp],
                              None if final is None else final[:, a * grp:b * grp], output_final_state)
                      for a, b in _threads.split(h, n_work)])
    return o.view(batch.out_shape), final
