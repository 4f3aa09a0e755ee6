"""A decode step's blocks as one compiled call each (`ext.GdnBlock` / `ext.AttnBlock`).

A block of a decode-only step is ~8 kernel calls (norms, the fused projections, the mixer, the
MLP) and the Python between them. After each weight-streaming GEMV the CPU caches hold weights, so
that Python runs cold, several times slower than warm: about a tenth of a batch-1 step
(docs/benchmarks.md, "Kernel history"). The compiled
block (csrc/decode_block.cpp) calls the same Tensor-level kernels on the same rows in the same
order, so its numbers are the per-op path's, bit for bit; only the Python goes.

`plan(model)` prepares one compiled block per block it can serve: a Gated DeltaNet (SiLU conv) or
full-attention mixer whose projections are fused (`kernels.fused`) and bias-free, between two
RMSNorms, then a SiLU gated MLP, weights fp32, bf16, int8 (with per-row scales) or GGML blocks
(a fused group may mix block types: `kernels.fused.BlockParts`), small parameters fp32. Any other block
(MoE, Mamba, KDA, MLA, biases, a module with forward hooks such as tensor parallelism's all-reduce)
keeps the per-op path: the decoder mixes both freely.
`for_step(model, batch)` returns the plan for a decode-only step when the kernels serve it, else
None; `per_op()` turns the compiled blocks off in a block (tests, the step profile's breakdown).
`head_for_step(head, batch, embed, lm_head)` does the same for an MTP head's whole forward
(`ext.MtpHead`: norms, fc, its attention block, norm, LM head and argmax in one call).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch.nn.modules import module as torch_module

from kvstate.kernels import Embedding, Linear, choice, extension
from kvstate.kernels import decode as kdecode
from kvstate.kernels.ggml_blocks import TYPES
from kvstate.kernels.threads import serial_outer_threads
from kvstate.layers.attention import Attention
from kvstate.layers.gated_deltanet import GatedDeltaNet
from kvstate.layers.mlp import GatedMLP
from kvstate.layers.norm import RMSNorm
from kvstate.layers.recurrence import clear_fresh
from kvstate.profiling import timed

_off: contextvars.ContextVar[bool] = contextvars.ContextVar("kvstate_per_op_blocks", default=False)
_WEIGHTS = (torch.float32, torch.bfloat16, torch.int8, torch.uint8)  # uint8: GGML blocks (kernels.blocks)


@contextlib.contextmanager
def per_op():
    """Inside the block, decode steps run every block op by op (the reference path)."""
    token = _off.set(True)
    try:
        yield
    finally:
        _off.reset(token)


def for_step(model, batch) -> list | None:
    """[compiled block or None per block] for this step, or None (not decode-only, or not served)."""
    if not (batch.decode_only or batch.verify_group is not None) or _off.get() or choice() != "auto" \
            or torch.is_grad_enabled():
        return None
    plans = getattr(model, "_decode_blocks", None)
    if plans is None or not all(g.intact() for g in plans[1]):  # a .to() since: build again
        plans = model._decode_blocks = plan(model)
    return plans[0] if any(p is not None for p in plans[0]) else None


@timed("compiled blocks")
def run(entry, x: torch.Tensor, delta: torch.Tensor | None, batch, cache):
    """The block as one call: (x + delta, its output delta), like `Block.forward_pending`.
    `entry`: (kind, compiled block) from the plan."""
    wide = serial_outer_threads() or 0
    kind, entry = entry
    if kind == "gdn":
        group = batch.groups[0] if batch.decode_only else batch.verify_group
        clear_fresh(cache.conv, group)  # entries with an empty cache start from zeros
        clear_fresh(cache.state, group)
        if batch.decode_only:
            big = kdecode.state_bytes(cache.state, len(group.slots)) >= kdecode.WIDE_STATE_BYTES
            return entry.run(x, delta, cache.conv, cache.state, group.slots, wide, big)
        big = kdecode.state_bytes(cache.state, x.shape[0]) >= kdecode.WIDE_STATE_BYTES
        x, delta, states, windows = entry.verify(x, delta, cache.conv, cache.state, group.slots, group.cu_seqlens,
                                                 wide, big)
        batch.rollback += [(cache.state, group, states, True), (cache.conv, group, windows, True)]  # keep_states
        return x, delta
    tables = batch.block_tables if batch.token_tables is None else batch.token_tables  # [T, max_blocks] in verify
    big = kdecode.kv_bytes(sum(batch.kv_lens), cache.k, cache.v) >= kdecode.WIDE_KV_BYTES
    return entry.run(x, delta, cache.k, cache.v, batch.positions, tables, batch.kv_indices, wide, big)


def head_for_step(head, batch, embed, lm_head):
    """The MTP head (kvstate.models.mtp) as one compiled call for this decode-only step, or None."""
    return compiled_head(head, embed, lm_head) if batch.decode_only else None


def compiled_head(head, embed, lm_head):
    """The MTP head's compiled forward (`ext.MtpHead`) for one-token rows, or None (not served, `per_op()`)."""
    if _off.get() or choice() != "auto" or torch.is_grad_enabled():
        return None
    made = getattr(head, "_compiled", None)
    if made is None or made[1] is not embed.weight or made[2] is not lm_head.weight \
            or not all(g.intact() for g in made[3]):  # a .to() since: build again
        groups: list = []
        made = head._compiled = (_head(head, embed, lm_head, groups), embed.weight, lm_head.weight, groups)
    return made[0]


@timed("compiled blocks")
def run_head(entry, ids: torch.Tensor, hidden: torch.Tensor, cache, positions: torch.Tensor, tables: torch.Tensor,
             kv_indices: torch.Tensor, kv_tokens: int):
    """(argmax [T], y [T, H], logits [T, V]) of the head's compiled forward over one-token rows at
    `positions` [T], their KV rows `kv_indices` [T], block tables [T, max_blocks]; `kv_tokens`: the
    keys they read in all (for the thread policy)."""
    big = kdecode.kv_bytes(kv_tokens, cache.k, cache.v) >= kdecode.WIDE_KV_BYTES
    return entry.run(ids, hidden, cache.k, cache.v, positions, tables, kv_indices, serial_outer_threads() or 0, big)


@timed("compiled blocks")
def chain_head(entry, ids: torch.Tensor, hidden: torch.Tensor, cache, start: torch.Tensor, tables: torch.Tensor,
               block_size: int, steps: int, kv_tokens: int) -> torch.Tensor:
    """Drafts [N, steps]: `steps` chained head steps per entry from ids [N] and y [N, H] at positions
    start [N], start + 1, ... in the entries' blocks tables [N, max_blocks] (`ext.MtpHead.chain`)."""
    big = kdecode.kv_bytes(kv_tokens, cache.k, cache.v) >= kdecode.WIDE_KV_BYTES
    return entry.chain(ids, hidden, cache.k, cache.v, start, tables, block_size, steps, serial_outer_threads() or 0,
                       big)


@timed("compiled blocks")
def run_chain_head(entry, ids: list[int], hidden: torch.Tensor, cache, start: int, table: list[int],
                   block_size: int, steps: int, serial: bool = False) -> list[int]:
    """One entry's drafts [1 + steps]: the head over its rows (the tokens `ids` after positions start ..
    start + len(ids) - 1, hidden [len(ids), H]: their KV written, draft 1 from the last row), then
    `steps` chained drafts from there, in the blocks of `table` (its block table, grown to cover the
    last draft), in one call. `serial`: the call under `small_ops_serial`'s policy, switched in C++
    (the context manager costs more than the call's rest)."""
    n = len(ids)
    big = kdecode.kv_bytes(n * start + n * (n + 1) // 2, cache.k, cache.v) >= kdecode.WIDE_KV_BYTES
    wide = serial_outer_threads() or (torch.get_num_threads() if serial else 0)
    return entry.run_chain(ids, hidden, cache.k, cache.v, start, table, block_size, steps, wide, big, serial)


def _head(head, embed, lm_head, groups):
    ext = extension()
    # a table of GGML blocks (`kernels.Embedding.weight_format`) is looked up per op
    if ext is None or _hooked(head) or type(embed) not in (torch.nn.Embedding, Embedding) \
            or getattr(embed, "weight_format", None):
        return None
    block = head.layers[0]
    made = _attention(ext, block, groups) if isinstance(block.mixer, Attention) and not _hooked(block) else None
    norms = [_norm(n) for n in (head.pre_fc_norm_embedding, head.pre_fc_norm_hidden, head.norm)]
    fc, out, w = _plain(ext, head.fc), _plain(ext, lm_head), embed.weight
    if made is None or fc is None or out is None or None in norms or len({n[1:] for n in norms}) != 1:
        return None
    if w.dtype not in (torch.float32, torch.bfloat16) or not w.is_contiguous() or not w.is_cpu:
        return None
    eps, offset = norms[0][1:]
    return ext.MtpHead(w, norms[0][0], norms[1][0], eps, offset, fc, made[1], norms[2][0], out)


def plan(model) -> tuple[list, list]:
    """([(kind, compiled block) or None per block], the fused groups they read: stale once one is not intact)."""
    ext = extension()
    blocks, groups = [], []
    for block in model.layers:
        made = None
        if ext is not None and not _hooked(block):
            made = _gdn(ext, block, groups) if isinstance(block.mixer, GatedDeltaNet) else \
                _attention(ext, block, groups) if isinstance(block.mixer, Attention) else None
        blocks.append(made)
    return blocks, groups


def _hooked(block) -> bool:
    """Any forward hook on the block or inside it (or a global one): its Python must run."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in block.modules())


def _fused(ext, linears, groups):
    """The fused weight (`ext.Weight`) of exactly these linears (bias-free, served dtype), or None."""
    group = getattr(linears[0], "fused_group", None)
    if any(type(m) is not Linear for m in linears) or group is None or group.members != tuple(linears):
        return None
    if getattr(group, "parts", False):  # GGML blocks of several types, each member its own tensor
        if not group.intact() or not hasattr(ext.Weight, "parts"):
            return None
        groups.append(group)
        return ext.Weight.parts(group.weights, [_type_id(f) for f in group.format])
    if not group.intact() or group.bias is not None or group.weight.dtype not in _WEIGHTS:
        return None
    groups.append(group)
    return ext.Weight(group.weight, group.scale, _type_id(group.format))


def _fp32(*tensors: torch.Tensor) -> bool:
    """Small parameters the kernels read: contiguous CPU float32."""
    return all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors)


def _plain(ext, linear):
    """The weight (`ext.Weight`) of a bias-free Linear of a served dtype, or None."""
    if type(linear) is not Linear:  # a subclass may do more than the GEMV
        return None
    w = linear.weight
    if linear.bias is None and w.dtype in _WEIGHTS and w.is_contiguous() and w.dim() == 2:
        return ext.Weight(w, linear.weight_scale, _type_id(linear.weight_format), linear.input_perm)
    return None


def _type_id(weight_format: str | None) -> int:
    """The GGML type number of a Linear's blocks (`kernels.blocks`), 0 for a plain weight."""
    return 0 if weight_format is None else TYPES[weight_format].type_id


def _norm(norm) -> tuple | None:
    if type(norm) is not RMSNorm or not _fp32(norm.weight):
        return None
    return norm.weight, norm.eps, norm.offset


def _tail(ext, block, groups) -> tuple | None:
    """(ffn norm weight, eps, offset, w_gate_up, w_down) for a SiLU gated MLP, or None."""
    ffn, norm = block.ffn, _norm(block.ffn_norm) if block.ffn is not None else None
    if norm is None or type(ffn) is not GatedMLP or ffn.act is not F.silu or (ffn.gate_scale, ffn.down_scale) != (1, 1):
        return None
    w_gu, w_down = _fused(ext, (ffn.gate_proj, ffn.up_proj), groups), _plain(ext, ffn.down_proj)
    return None if w_gu is None or w_down is None else (*norm, w_gu, w_down)


def _gdn(ext, block, groups):
    m = block.mixer
    norm, tail = _norm(block.input_norm), _tail(ext, block, groups)
    w_in = _fused(ext, (m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a), groups)
    w_out, gn = _plain(ext, m.out_proj), m.norm
    small = (m.conv_weight, m.A_log, m.dt_bias, gn.weight)
    if None in (norm, tail, w_in, w_out) or m.act != "silu" or not _fp32(*small):
        return None
    if not (gn.norm_before_gate and gn.activation == "silu" and gn.group_size == m.head_v_dim):
        return None
    return "gdn", ext.GdnBlock(*norm, w_in, m.conv_dim, m.value_dim, m.num_v_heads, m.conv_weight, m.A_log,
                               m.dt_bias, gn.weight, gn.eps, m.head_k_dim**-0.5, m.num_k_heads, w_out, *tail)


def _attention(ext, block, groups):
    m = block.mixer
    norm, tail = _norm(block.input_norm), _tail(ext, block, groups)
    w_qkv, w_o = _fused(ext, (m.q_proj, m.k_proj, m.v_proj), groups), _plain(ext, m.o_proj)
    if None in (norm, tail, w_qkv, w_o) or (m.q_norm is None) != (m.k_norm is None) or m.key_scale != 1:
        return None
    qn = kn = None
    eps = offset = 0.0
    if m.q_norm is not None:
        qn, kn = _norm(m.q_norm), _norm(m.k_norm)
        if qn is None or kn is None or qn[1:] != kn[1:]:
            return None
        (qn, eps, offset), kn = qn, kn[0]
    inv_freq = None
    if m.rotary is not None:
        inv_freq = m.rotary.inv_freq
        if 2 * inv_freq.numel() != m.rotary.rotary_dim or not _fp32(inv_freq):
            return None
    return "attention", ext.AttnBlock(*norm, w_qkv, m.num_heads, m.num_kv_heads, m.head_dim, m.head_dim,
                                      m.output_gate, qn, kn, eps, offset, inv_freq, m.scale, w_o, *tail)
