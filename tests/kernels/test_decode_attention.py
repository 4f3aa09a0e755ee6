"""The fused attention decode kernel (`kernels.decode.attention_decode`) against the layer's torch
path: output gate, q/k RMSNorm and partial rotary on or off, grouped KV heads, head dims not
multiples of 8, batch 1..17 with different context lengths in scattered KV blocks; the same
output and the same KV pool afterwards."""

from types import SimpleNamespace

import pytest
import torch

from kvstate import kernels
from kvstate.kernels import _ext
from kvstate.layers.attention import Attention
from kvstate.layers.rope import Rotary
from kvstate.models.batch import Batch
from tests.kernels.conftest import extension
from tests.kernels.test_decode_gdn import Spy
from tests.kernels.test_decode_ops import rel

BLOCK = 4


def layer(gated: bool, seed: int = 0, h: int = 6, hkv: int = 2, d: int = 20) -> Attention:
    torch.manual_seed(seed)
    m = Attention(36, h, hkv, d, output_gate=gated, qk_norm=(1e-6, 1.0) if gated else None,
                  rotary=Rotary(d, 8, 10000.0) if gated else None).requires_grad_(False)
    for p in m.parameters():
        p.normal_().mul_(p.shape[-1] ** -0.5 if p.dim() == 2 else 0.3)
    return m


def decode_step(n: int, g: torch.Generator, block: int = BLOCK, longest: int = 40, pool: int = 200):
    """A decode batch of n entries with contexts 0..longest in shuffled, scattered blocks of a pool."""
    ctx = torch.randint(0, longest + 1, (n,), generator=g).tolist()
    ctx[0] = 0 if n > 1 else 5  # a first token as well
    free = torch.randperm(pool, generator=g).tolist()
    tables = [[free.pop() for _ in range(c // block + 1)] for c in ctx]
    return Batch.build([1] * n, ctx, list(range(n)), tables, block)


@pytest.mark.parametrize("gated", [True, False])
def test_fused_equals_torch(gated, monkeypatch):
    ext = extension()
    m = layer(gated)
    g = torch.Generator().manual_seed(1)
    calls = []
    monkeypatch.setattr(_ext, "_loaded", {"module": Spy(ext, calls), "reason": None})
    for n in (1, 3, 17):
        batch = decode_step(n, g)
        cache = SimpleNamespace(k=torch.randn(200, BLOCK, 2, 20, generator=g),
                                v=torch.randn(200, BLOCK, 2, 20, generator=g))
        check_against_torch(m, torch.randn(n, 36, generator=g), batch, cache, calls)


# (query heads, KV heads, head dim, block size): each grouping the kernel has a register path for
# (G = 1, 2, 3, 4 two keys at a time; G = 8 one; G = 6 the generic loop), head dims with and without
# whole chunks of 8 and 16 channels, block sizes a power of two and not, contexts over many blocks.
SHAPES = [(4, 4, 24, 16), (8, 4, 16, 6), (8, 2, 32, 16), (8, 1, 20, 16), (12, 2, 8, 5), (6, 2, 20, 4)]


@pytest.mark.parametrize("h,hkv,d,block", SHAPES)
def test_every_head_grouping_and_block_size(h, hkv, d, block, monkeypatch):
    ext = extension()
    m = layer(True, 3, h, hkv, d)
    g = torch.Generator().manual_seed(h * d + block)
    calls = []
    monkeypatch.setattr(_ext, "_loaded", {"module": Spy(ext, calls), "reason": None})
    pool = 9 * (150 // block + 1)
    for n in (1, 2, 9):
        batch = decode_step(n, g, block, longest=150, pool=pool)
        cache = SimpleNamespace(k=torch.randn(pool, block, hkv, d, generator=g),
                                v=torch.randn(pool, block, hkv, d, generator=g))
        check_against_torch(m, torch.randn(n, 36, generator=g), batch, cache, calls)


def test_long_contexts_fetch_values_in_the_value_pass(monkeypatch):
    """Past 256 KiB of a head's values (here 1,100 and 1,500 keys of 64 channels) the kernel fetches
    the values a block ahead in the value pass rather than during the key pass; short and long
    entries in one batch."""
    ext = extension()
    m = layer(True, 5, 8, 2, 64)
    g = torch.Generator().manual_seed(5)
    calls = []
    monkeypatch.setattr(_ext, "_loaded", {"module": Spy(ext, calls), "reason": None})
    block, ctx = 16, [1500, 7, 1100]
    free = torch.randperm(200, generator=g).tolist()
    tables = [[free.pop() for _ in range(c // block + 1)] for c in ctx]
    batch = Batch.build([1] * len(ctx), ctx, list(range(len(ctx))), tables, block)
    shape = (200, block, 2, 64)
    cache = SimpleNamespace(k=torch.randn(shape, generator=g), v=torch.randn(shape, generator=g))
    check_against_torch(m, torch.randn(len(ctx), 36, generator=g), batch, cache, calls)


def check_against_torch(m, x, batch, cache, calls: list) -> None:
    """The layer with the kernel (run once, seen by the spy's `calls`) and forced to torch on a copy
    of the cache: the same output and the same KV pool."""
    ref_cache = SimpleNamespace(k=cache.k.clone(), v=cache.v.clone())
    calls.clear()
    with torch.inference_mode():
        with kernels.backend("torch"):
            ref = m(x, batch, ref_cache)
        y = m(x, batch, cache)
    assert calls.count("attention_decode") == 1, calls
    assert rel(y, ref) < 1e-5
    assert rel(cache.k, ref_cache.k) < 1e-6 and torch.equal(cache.v, ref_cache.v)


def test_rows_outside_the_pool_are_refused():
    extension()
    m = layer(True)
    g = torch.Generator().manual_seed(2)
    cache = SimpleNamespace(k=torch.zeros(3, BLOCK, 2, 20), v=torch.zeros(3, BLOCK, 2, 20))
    batch = Batch.build([1], [5], [0], [[0, 7]], BLOCK)  # block 7 of a 3-block pool
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside the pool"):
        m(torch.randn(1, 36, generator=g), batch, cache)


@pytest.mark.parametrize("big", [False, True])
def test_attention_gets_all_threads_when_it_reads_enough_kv(big, monkeypatch):
    """Inside `small_ops_serial` the kernel runs on one thread, unless the KV rows it reads reach
    `WIDE_KV_BYTES`: then on all the step's threads (batch 8 of the 0.5b model: 1.6x)."""
    from kvstate.kernels import decode as kdecode
    from kvstate.kernels import threads

    ext = extension()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    m = layer(True)
    g = torch.Generator().manual_seed(2)
    seen = []

    class ThreadSpy(Spy):
        def __getattr__(self, name):
            fn = getattr(self.ext, name)
            return lambda *a, **k: (seen.append((name, torch.get_num_threads())), fn(*a, **k))[1]

    monkeypatch.setattr(_ext, "_loaded", {"module": ThreadSpy(ext, []), "reason": None})
    monkeypatch.setattr(kdecode, "WIDE_KV_BYTES", 0 if big else 1 << 40)
    batch = decode_step(5, g)
    cache = SimpleNamespace(k=torch.randn(200, BLOCK, 2, 20, generator=g),
                            v=torch.randn(200, BLOCK, 2, 20, generator=g))
    try:
        with torch.inference_mode(), threads.small_ops_serial():
            m(torch.randn(5, 36, generator=g), batch, cache)
    finally:
        torch.set_num_threads(before)
    assert [n for name, n in seen if name == "attention_decode"] == [2 if big else 1]
