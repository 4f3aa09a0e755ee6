"""The chunk-scan machinery of the delta-family chunk forms (gated delta rule, gated linear attention):
the state carried across chunks, where chunk outputs go, and the split over key-head groups.

Inputs come flattened to tokens (`_inputs.FlatInputs`); chunks are laid out step-major
(`_layout.ChunkLayout`): step j holds chunk j of every sequence still running, a prefix of the
sequences sorted longest first, so the sequential scan over chunks updates a prefix of the state
rows in place and never computes padding chunks.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from kvstate.ops import _threads
from kvstate.ops._inputs import FlatInputs, normalize_qk
from kvstate.ops._layout import ChunkLayout, chunk_layout, gather, scatter_, unchunk


def decay_mask(b: torch.Tensor) -> torch.Tensor:
    """exp(b_i - b_j) for j <= i, 0 above the diagonal: b [..., C] cumulative log decay -> [..., C, C].

    Only non-positive differences are exponentiated (-inf above the diagonal), so huge decays
    underflow to 0 instead of overflowing. In-place after the first op (autograd-safe).
    """
    c = b.shape[-1]
    upper = torch.ones(c, c, dtype=torch.bool, device=b.device).triu(1)
    return (b[..., :, None] - b[..., None, :]).masked_fill_(upper, float("-inf")).exp_()


def sorted_initial(flat: FlatInputs, lay: ChunkLayout, shape: tuple[int, ...]) -> torch.Tensor:
    """Initial states in rank order [N, HV, K, V] (zeros when none was given)."""
    if flat.s0 is None:
        return torch.zeros(flat.n_seq, *shape, dtype=flat.acc, device=flat.q.device)
    return lay.by_rank(flat.s0.to(flat.acc))


def needs_grad(*xs) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


class Carry:
    """The state carried across chunks, in rank order, for one chunked call.

    Inference (grad=False): one buffer [N, HV, K, V], each step updates the rows of the sequences
    still running in place; rows of finished sequences keep their final state. Training
    (grad=True): out-of-place, so that autograd sees a plain graph.
    """

    def __init__(self, init: torch.Tensor, lay: ChunkLayout, grad: bool, dst: torch.Tensor | None = None):
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

    def run(self, s0: int, steps, step, *rows: torch.Tensor | None) -> None:
        """Run one block's steps: step(r, m, state [m, HV, K, V], *pieces) handles block rows r..r+m,
        `pieces` being each step's rows of the block tensors `rows` ([n, ...], or None). They are
        split once: under autograd the backward of a split is one concatenation, where a slice per
        step and tensor would fill a block-size gradient each.

        In inference mode `step` updates `state` in place; in grad mode it returns the new state.
        """
        sizes = [m for _, m, _ in steps]
        pieces = [[None] * len(sizes) if x is None else x.split(sizes) for x in rows]
        for j, (off, m, m_next) in enumerate(steps):
            args = [p[j] for p in pieces]
            if self.grad:
                new = step(off - s0, m, self.cur, *args)
                self.finished.append(new[m_next:])
                self.cur = new[:m_next]
            else:
                step(off - s0, m, self.buf[:m], *args)

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

    def __init__(self, lay: ChunkLayout, tot: int, hv: int, dv: int, dtype: torch.dtype, acc: torch.dtype, device,
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
        t0 = self.lay.run_start(slot, slot + m) if m == 1 else None
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


class ChunkScan:
    """One call of a chunk kernel: the layout, the state carried across chunks and the outputs.

    The kernels (gated delta rule, gated linear attention) differ only in what they compute for a
    block of chunks and for one step of the scan; this is what they share.
    """

    def __init__(self, flat: FlatInputs, chunk_size: int, grad: bool, o_dst: torch.Tensor | None,
                 s_dst: torch.Tensor | None):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        _, hv, dk, dv = flat.dims
        dev = flat.q.device
        self.flat, self.grad, self.s_dst = flat, grad, s_dst
        self.lay = chunk_layout(flat.lens, flat.starts, chunk_size, dev)
        self.carry = Carry(sorted_initial(flat, self.lay, (hv, dk, dv)), self.lay, grad, s_dst)
        self.out = Output(self.lay, flat.q.shape[0], hv, dv, flat.dtype, flat.acc, dev, grad, o_dst)

    def gather(self, x: torch.Tensor, s0: int, n: int) -> torch.Tensor:
        """Tokens [tot, H, *D] -> chunks [n, H, C, *D] of slots s0..s0+n in the accumulation dtype."""
        return gather(x, self.lay, s0, s0 + n, self.flat.acc)

    def blocks(self, budget: int, l2: bool):
        """Per block of about `budget` bytes of [slots, HV, C, max(K, V)] temporaries, yields
        (first slot, slots n, steps for Carry.run, q, k [n, H, C, K], v [n, H, G, C, V])."""
        b, c = self.flat, self.lay.chunk
        h, hv, dk, dv = b.dims
        for s0, s1, steps in self.lay.blocks(hv * c * max(dk, dv) * 4, budget):
            n = s1 - s0
            qc, kc = normalize_qk(self.gather(b.q, s0, n), self.gather(b.k, s0, n), b.acc, l2, inplace=not self.grad)
            yield s0, n, steps, qc, kc, self.gather(b.v, s0, n).view(n, h, hv // h, c, dv)

    def result(self, output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(o [tot, HV, V], final state [N, HV, K, V] in sequence order, or None)."""
        final = self.lay.by_sequence(self.carry.final()) if output_final_state else None
        if self.s_dst is not None and final is not self.s_dst:
            self.s_dst.copy_(final)
        return self.out.result(), final


def split_heads(flat: FlatInputs, h0: int, h1: int) -> FlatInputs:
    """The part of the inputs with key heads h0..h1 and their value heads (views, no copies)."""
    grp = flat.dims[1] // flat.dims[0]
    hv = slice(h0 * grp, h1 * grp)
    cut = lambda x: None if x is None else x[:, hv]  # noqa: E731
    return replace(flat, q=flat.q[:, h0:h1], k=flat.k[:, h0:h1], v=flat.v[:, hv], g=cut(flat.g),
                   beta=cut(flat.beta), s0=cut(flat.s0), out_shape=(*flat.out_shape[:2], (h1 - h0) * grp,
                                                                       flat.out_shape[3]))


def run_split(flat: FlatInputs, kernel, *, output_final_state: bool, captures: list | None = None, **kernel_kw):
    """Run kernel(flat, o_dst, s_dst, output_final_state, grad=..., **kernel_kw) -> (o [tot, HV, V],
    final or None), in parallel over key-head groups when the call is big enough and autograd does
    not record (kvstate/ops/_threads.py). `captures` [(sequence, p)]: the kernel also writes the
    state after each sequence's first p tokens into `c_dst` [len(captures), HV, K, V].

    Returns (o [B, T, HV, V] in the input dtype, final_state [N, HV, K, V] or None[, the captured states]).
    """
    h, hv, dk, dv = flat.dims
    grad = needs_grad(flat.q, flat.k, flat.v, flat.g, flat.beta, flat.s0)
    dev = flat.q.device
    cap = None
    if captures:
        if grad:
            raise ValueError("states at positions are an inference feature (no autograd)")
        cap = torch.empty(len(captures), hv, dk, dv, dtype=flat.acc, device=dev)
        kernel_kw = dict(kernel_kw, captures=captures)
    kernel = partial(kernel, grad=grad, **kernel_kw)
    with _threads.scope(flat.q.shape[0] * hv * dk * dv, h, serial=not grad) as n_work:
        if n_work == 1:
            o, final = kernel(flat, None, None, output_final_state, **({} if cap is None else {"c_dst": cap}))
            return (o.to(flat.dtype).view(flat.out_shape), final) + (() if cap is None else (cap,))
        grp = hv // h
        o = torch.empty(flat.q.shape[0], hv, dv, dtype=flat.dtype, device=dev)
        final = torch.empty(flat.n_seq, hv, dk, dv, dtype=flat.acc, device=dev) if output_final_state else None
        _threads.run([partial(kernel, split_heads(flat, a, b), o[:, a * grp:b * grp],
                              None if final is None else final[:, a * grp:b * grp], output_final_state,
                              **({} if cap is None else {"c_dst": cap[:, a * grp:b * grp]}))
                      for a, b in _threads.split(h, n_work)])
    return (o.view(flat.out_shape), final) + (() if cap is None else (cap,))


def run_at(flat: FlatInputs, kernel, state_positions: list[list[int]] | None, *, output_final_state: bool,
           **kernel_kw):
    """`run_split`, and with `state_positions` (per sequence, token counts 0 < p < its length) also the
    states there, per sequence a list of [HV, K, V], written by the kernel's own scan (`captures`)."""
    if state_positions is None:
        return run_split(flat, kernel, output_final_state=output_final_state, **kernel_kw)
    captures = [(i, p) for i, ps in enumerate(state_positions) for p in ps]
    if any(not 0 < p < flat.lens[i] for i, p in captures):
        raise ValueError(f"state_positions must lie inside their sequences (lengths {flat.lens})")
    if not captures:
        return (*run_split(flat, kernel, output_final_state=output_final_state, **kernel_kw),
                [[] for _ in state_positions])
    o, final, cap = run_split(flat, kernel, output_final_state=output_final_state, captures=captures, **kernel_kw)
    return o, final, per_sequence(cap, state_positions)


def per_sequence(cap: torch.Tensor, state_positions: list[list[int]]) -> list[list[torch.Tensor]]:
    """Captured states [n, ...] in (sequence, position) order -> per sequence the list of its states."""
    states, n = [], 0
    for ps in state_positions:
        states.append(list(cap[n:n + len(ps)]))
        n += len(ps)
    return states


def capture_plan(lay, captures: list | None) -> dict[int, list[tuple[int, int, int]]]:
    """{first slot of step j: [(rank, offset o, capture index)]}: the state after p tokens is the
    state entering chunk j = p // C advanced by its first o = p % C tokens."""
    plan: dict[int, list[tuple[int, int, int]]] = {}
    for index, (seq, p) in enumerate(captures or ()):
        j, o = divmod(p, lay.chunk)
        plan.setdefault(lay.steps[j][0], []).append((int(lay.rank[seq]), o, index))
    return plan


def partial_state(s: torch.Tensor, k: torch.Tensor, b: torch.Tensor | None, vn: torch.Tensor, o: int,
                  grp: int) -> torch.Tensor:
    """The state after the first o tokens of a chunk: s [HV, K, V] entering it, k [H, C, K] its keys,
    b [H, G, C] cumulative log decays (None: no decay), vn [HV, C, V] the deltas written.
    S_o = e^{b_o} s + sum_{t<o} e^{b_o - b_t} k_t vn_t^T (per value head; o = 0: s itself)."""
    if o == 0:
        return s.clone()
    h, c, dk = k.shape
    kt = k[:, None, :o].expand(h, grp, o, dk)  # [H, G, o, K]: a key head serves its group of value heads
    if b is None:
        return torch.baddbmm(s, kt.reshape(h * grp, o, dk).transpose(1, 2), vn[:, :o])
    last = b[..., o - 1:o]  # [H, G, 1]
    kd = kt * (last - b[..., :o]).exp().unsqueeze(-1)  # keys decayed to token o
    return torch.baddbmm(s * last.exp().reshape(h * grp, 1, 1), kd.reshape(h * grp, o, dk).transpose(1, 2),
                         vn[:, :o])
