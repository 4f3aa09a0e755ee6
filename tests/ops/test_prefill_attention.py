"""Paged attention for prompts and training batches: SDPA's memory-lean path on CPU, and the
fresh-sequence path (every sequence starts from nothing) equal to the pool path, gradients included."""

import json
import subprocess
import sys

import pytest
import torch

from kvstate.models.batch import Batch
from kvstate.ops.attention import _all_fresh, paged_attention, write_kv

_PEAK = """
import json, resource, sys, torch
from kvstate.models.batch import Batch
from kvstate.ops.attention import paged_attention, write_kv
torch.set_num_threads(1)
ctx, q_len, H, Hkv, D, bs = 4096 - int(sys.argv[1]), int(sys.argv[1]), 8, 2, 32, 16
n = ctx + q_len
blocks = list(range(n // bs))
k_cache, v_cache = torch.randn(len(blocks), bs, Hkv, D), torch.randn(len(blocks), bs, Hkv, D)
batch = Batch.build([q_len], [ctx], [0], [blocks], bs)
q = torch.randn(q_len, H, D)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():
    o = paged_attention(q, k_cache, v_cache, batch, scale=D ** -0.5)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew_mb": (after - before) / 1024, "shape": list(o.shape)}))
"""


_PEAK_MLA = """
import json, resource, torch
from types import SimpleNamespace
from kvstate.layers.mla import MLA
from kvstate.models.batch import Batch
torch.set_num_threads(1)
n, bs = 4096, 16
layer = MLA(32, 8, 16, 16, 8, 16).eval()
batch = Batch.build([n], [0], [0], [list(range(n // bs))], bs)
cache = SimpleNamespace(latent=torch.zeros(n // bs, bs, 16 + 8))
x = torch.randn(n, 32)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():
    o = layer(x, batch, cache)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew_mb": (after - before) / 1024, "shape": list(o.shape)}))
"""


def test_mla_prompt_does_not_materialise_the_score_matrix():
    """Kimi's MLA prefill (4,096 tokens, 8 heads) decompresses K/V per head and attends: 512 MiB of
    scores in the math path, a few MiB in the flash path."""
    out = subprocess.run([sys.executable, "-c", _PEAK_MLA], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    assert r["shape"] == [4096, 32]
    assert r["grew_mb"] < 96, r


@pytest.mark.parametrize("q_len", [4096, 2048], ids=["whole-prompt", "chunk-after-context"])
def test_prompt_attention_does_not_materialise_the_score_matrix(q_len):
    """A 4,096-token prompt (or a 2,048-token chunk after 2,048 cached), 8 heads: every [q, kv] score
    matrix in fp32 is 512 MiB (256 MiB); SDPA's math path, which 3-D inputs took, allocates them.
    The flash path streams blocks of them and grows the process by a few MiB."""
    out = subprocess.run([sys.executable, "-c", _PEAK, str(q_len)], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    assert r["shape"] == [q_len, 8, 32]
    assert r["grew_mb"] < 96, r


def _pool_batch(lens, heads, kv_heads, dim, seed):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, heads, dim, generator=g, dtype=torch.float64).requires_grad_()
    k = torch.randn(t, kv_heads, dim, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(t, kv_heads, dim + 8, generator=g, dtype=torch.float64).requires_grad_()
    bs = 8
    tables, nxt = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(list(range(nxt + nb - 1, nxt - 1, -1)))  # blocks in reverse: not a view
        nxt += nb
    batch = Batch.build(list(lens), [0] * len(lens), list(range(len(lens))), tables, bs)
    return q, k, v, batch, nxt, bs


def _naive(q, k, v, lens, scale):
    """Per sequence, per head: softmax(q k^T * scale, causal) v in float64 (grouped heads by repeat)."""
    outs, start, group = [], 0, q.shape[1] // k.shape[1]
    for n in lens:
        qi, ki, vi = q[start:start + n], k[start:start + n], v[start:start + n]
        ki, vi = ki.repeat_interleave(group, 1), vi.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vi))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("lens", [[37, 5, 64, 1, 20], [9], [16, 16]])
def test_fresh_sequences_equal_the_pool_path_and_the_naive_form_with_gradients(lens):
    """With the step's own K/V (`fresh`), values and gradients equal the path that reads K/V back
    from the pool, and the naive causal softmax, on sequences of mixed lengths (one of one token)."""
    heads, kv_heads, dim = 4, 2, 16
    scale = dim ** -0.5
    results = []
    for fresh in (True, False):
        q, k, v, batch, blocks, bs = _pool_batch(lens, heads, kv_heads, dim, seed=len(lens))
        k_cache = torch.zeros(blocks, bs, kv_heads, dim, dtype=torch.float64)
        v_cache = torch.zeros(blocks, bs, kv_heads, dim + 8, dtype=torch.float64)
        write_kv(k_cache, k, batch.kv_indices)
        write_kv(v_cache, v, batch.kv_indices)
        o = paged_attention(q, k_cache, v_cache, batch, scale=scale, fresh=(k, v) if fresh else None)
        ref = _naive(q, k, v, lens, scale)
        torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        (o * w).sum().backward()
        results.append([o.detach(), q.grad, k.grad, v.grad])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_fresh_rows_are_not_used_when_the_pool_rounds_them():
    """A bf16 pool reads back rounded K/V: the step's fp32 rows would differ, so the pool is read."""
    q, k, v, batch, blocks, bs = _pool_batch([12, 7], 2, 2, 8, seed=3)
    k = k.detach().float()
    assert _all_fresh(batch, (k, v), torch.zeros(blocks, bs, 2, 8))
    assert not _all_fresh(batch, (k, v), torch.zeros(blocks, bs, 2, 8, dtype=torch.bfloat16))
    later = Batch.build([3, 7], [9, 0], [0, 1], [[0, 1], [2]], bs)  # one sequence has context
    assert not _all_fresh(later, (k[:10], v[:10]), torch.zeros(blocks, bs, 2, 8))
