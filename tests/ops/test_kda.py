"""KDA ops (kvstate.ops.kda): chunk and recurrent forms against the naive form (run in fp64),
against transformers' Kimi Linear fallbacks, split-and-carry, varlen, gradients, edge inputs,
the spec's worked delta-rule numbers, and argument errors."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvstate.ops.kda import chunk_kda, naive_kda, recurrent_kda
from kvstate.ops.kda.intra import SAFE_EXPONENT, SUB_CHUNK, decay_factors, intra_scores
from kvstate.ops.kda.solve import unit_lower_inverse

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOL = 1e-5  # relative error of the fp32 fast forms against the fp64 naive form


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def inputs(b, t, h, hv, dk, dv, *, seed=0, l2=True, gate=1.0, state=True, dtype=torch.float32):
    """Random KDA inputs. Without L2 norm the keys have norm < 1 so the delta rule stays stable."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = r(b, t, h, dk), r(b, t, h, dk)
    if not l2:
        k = 0.9 * k / k.norm(dim=-1, keepdim=True).clamp_min(1.0)
    g = F.logsigmoid(r(b, t, hv, dk)) * gate
    beta = torch.rand(b, t, hv, generator=gen, dtype=torch.float64)
    s0 = r(b, hv, dk, dv) if state else None
    out = [x.to(dtype) for x in (q, k, r(b, t, hv, dv), g, beta)]
    return out, (None if s0 is None else s0.to(dtype))


def reference(args, s0, **kw):
    """The naive form in fp64."""
    return naive_kda(*(x.double() for x in args), initial_state=None if s0 is None else s0.double(),
                     output_final_state=True, **kw)


# (B, T, H, K, V, L2 norm): every T in {1, 63, 65, 500} and head dim in {48, 64, 100, 128}; HV = 2 H
SHAPES = [(3, 1, 1, 48, 64, True), (2, 63, 2, 64, 48, False), (1, 65, 1, 100, 128, True),
          (1, 500, 1, 128, 100, True), (1, 130, 2, 48, 48, False)]


@pytest.mark.parametrize("b,t,h,dk,dv,l2", SHAPES, ids=[f"T{s[1]}-K{s[3]}-V{s[4]}" for s in SHAPES])
@pytest.mark.parametrize("form", [chunk_kda, recurrent_kda], ids=["chunk", "recurrent"])
def test_fast_forms_match_naive(form, b, t, h, dk, dv, l2):
    args, s0 = inputs(b, t, h, 2 * h, dk, dv, l2=l2)
    o_ref, s_ref = reference(args, s0, use_qk_l2norm_in_kernel=l2)
    o, s = form(*args, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    assert o.shape == (b, t, 2 * h, dv) and o.dtype == torch.float32 and s.shape == (b, 2 * h, dk, dv)
    assert rel(o, o_ref) <= TOL and rel(s, s_ref) <= TOL


@pytest.mark.parametrize("h", [2, 1], ids=["heads-equal", "grouped"])
@pytest.mark.parametrize("form", [chunk_kda, recurrent_kda, naive_kda], ids=["chunk", "recurrent", "naive"])
def test_matches_transformers(form, h):
    """transformers needs as many key heads as value heads: grouped q, k are repeat_interleave'd for it."""
    from transformers.models.kimi_linear.modeling_kimi_linear import (chunk_kimi_delta_attention,
                                                                      recurrent_kimi_delta_attention)
    (q, k, v, g, beta), s0 = inputs(2, 100, h, 2, 64, 64, seed=1)
    o, s = form(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    q, k = q.repeat_interleave(2 // h, dim=2), k.repeat_interleave(2 // h, dim=2)
    for ref in (chunk_kimi_delta_attention, recurrent_kimi_delta_attention):
        o_ref, s_ref = ref(q, k, v, g, beta, initial_state=s0.clone(), output_final_state=True,
                           use_qk_l2norm_in_kernel=True)
        assert rel(o, o_ref) <= TOL and rel(s, s_ref) <= TOL


@pytest.mark.parametrize("form", [chunk_kda, recurrent_kda, naive_kda], ids=["chunk", "recurrent", "naive"])
def test_a_given_scale_matches_transformers(form):
    """transformers takes no scale (it multiplies q by K^-0.5): without the L2 norm, q * scale * K^0.5
    given to it is `scale` times q, an independent check of how every form applies a given scale."""
    from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

    (q, k, v, g, beta), s0 = inputs(1, 40, 2, 2, 32, 16, seed=4, l2=False)
    o, s = form(q, k, v, g, beta, scale=0.7, initial_state=s0, output_final_state=True)
    o_ref, s_ref = recurrent_kimi_delta_attention(q * (0.7 * 32**0.5), k, v, g, beta, initial_state=s0.clone(),
                                                  output_final_state=True)
    assert rel(o, o_ref) <= TOL and rel(s, s_ref) <= TOL


def test_worked_delta_rule_example():
    """The spec's delta-rule example (g = 0, beta = 1): after writing k1 -> [5, 1], k2 -> [2, 4],
    k3 -> [0.6, 0.8] -> [0, 6], reading k1, k2, k3 gives [2.24, 2.32], [-1.68, 5.76], [0, 6]."""
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    k = torch.cat([keys, torch.zeros(3, 2)]).view(1, 6, 1, 2)  # three writes, then three reads
    q = torch.cat([keys, keys]).view(1, 6, 1, 2)
    v = torch.tensor([[5.0, 1.0], [2.0, 4.0], [0.0, 6.0]] + [[0.0, 0.0]] * 3).view(1, 6, 1, 2)
    beta = torch.tensor([1.0, 1, 1, 0, 0, 0]).view(1, 6, 1)
    g = torch.zeros(1, 6, 1, 2)
    want = torch.tensor([[2.24, 2.32], [-1.68, 5.76], [0.0, 6.0]])
    for form in (naive_kda, chunk_kda, recurrent_kda):
        o, _ = form(q, k, v, g, beta, scale=1.0)
        torch.testing.assert_close(o[0, 3:, 0], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("form", [chunk_kda, recurrent_kda], ids=["chunk", "recurrent"])
def test_split_and_carry(form):
    (q, k, v, g, beta), s0 = inputs(2, 150, 1, 2, 64, 48, seed=2)
    o_all, s_all = form(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    state, outs = s0, []
    for a, z in ((0, 37), (37, 101), (101, 150)):  # uneven pieces, chunk boundaries crossed
        o, state = form(q[:, a:z], k[:, a:z], v[:, a:z], g[:, a:z], beta[:, a:z], initial_state=state,
                        output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o)
    assert rel(torch.cat(outs, 1), o_all) <= TOL and rel(state, s_all) <= TOL


def test_recurrent_equals_chunk():
    args, s0 = inputs(2, 70, 2, 4, 48, 64, seed=3)
    o_c, s_c = chunk_kda(*args, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_r, s_r = recurrent_kda(*args, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel(o_r, o_c) <= TOL and rel(s_r, s_c) <= TOL


@pytest.mark.parametrize("form", [chunk_kda, recurrent_kda, naive_kda], ids=["chunk", "recurrent", "naive"])
def test_varlen_equals_separate_runs(form):
    lens = [17, 0, 83, 65, 1]  # a zero-length sequence in the middle
    cu = torch.tensor([0] + lens).cumsum(0)
    (q, k, v, g, beta), s0 = inputs(1, sum(lens), 1, 2, 48, 64, seed=4)
    s0 = torch.randn(len(lens), 2, 48, 64)
    o, s = form(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu)
    assert o.shape == v.shape and s.shape == s0.shape
    for i, (a, z) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_i, s_i = form(q[:, a:z], k[:, a:z], v[:, a:z], g[:, a:z], beta[:, a:z], initial_state=s0[i : i + 1],
                        output_final_state=True, use_qk_l2norm_in_kernel=True)
        if z == a:
            assert torch.equal(s[i], s0[i])  # nothing ran: the state is untouched
        else:
            assert rel(o[:, a:z], o_i) <= TOL
        assert rel(s[i : i + 1], s_i) <= TOL


@pytest.mark.parametrize("cu", [None, [0, 130, 131, 131, 200, 330]], ids=["dense", "varlen"])
def test_chunk_slabs_and_chunk_sizes(monkeypatch, cu):
    """One chunk per slab (every step its own slab) and other chunk sizes give the same results."""
    import kvstate.ops.kda.chunk as chunk_module

    (q, k, v, g, beta), s0 = inputs(1, 330, 1, 2, 32, 32, seed=13)
    cu = None if cu is None else torch.tensor(cu)
    s0 = s0 if cu is None else torch.randn(5, 2, 32, 32)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    o_ref, s_ref = reference((q, k, v, g, beta), s0, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    for rows, size in ((64, 32), (128, 64), (4096, 16), (4096, 128)):
        monkeypatch.setattr(chunk_module, "SLAB_ROWS", rows)
        o, s = chunk_kda(q, k, v, g, beta, chunk_size=size, **kw)
        assert rel(o, o_ref) <= TOL and rel(s, s_ref) <= TOL


def test_recurrent_all_states():
    """all_states[:, t] is the state after token t (what speculative decoding rolls back to)."""
    args, s0 = inputs(2, 5, 1, 2, 48, 48, seed=5)
    o, s, states = recurrent_kda(*args, initial_state=s0, output_final_state=True, output_all_states=True)
    assert states.shape == (2, 5, 2, 48, 48) and torch.equal(states[:, -1], s)
    for t in range(5):
        _, s_t = reference([x[:, : t + 1] for x in args], s0)
        assert rel(states[:, t], s_t) <= TOL
    cu = torch.tensor([0, 2, 2, 5])  # packed, with a zero-length sequence
    packed = [x.reshape(1, 10, *x.shape[2:])[:, :5] for x in args]
    s0 = torch.randn(3, 2, 48, 48)
    _, s, states = recurrent_kda(*packed, initial_state=s0, output_final_state=True, output_all_states=True,
                                 cu_seqlens=cu)
    assert states.shape == (1, 5, 2, 48, 48)
    assert torch.equal(states[0, 1], s[0]) and torch.equal(s[1], s0[1]) and torch.equal(states[0, 4], s[2])


def test_recurrent_state_pool_in_place():
    """state_indices pick rows of a state pool; inplace_final_state updates exactly those rows."""
    (q, k, v, g, beta), _ = inputs(3, 4, 1, 2, 32, 16, seed=14)
    pool = torch.randn(5, 2, 32, 16)
    idx = torch.tensor([4, 0, 2])
    o_ref, want = reference((q, k, v, g, beta), pool[idx], use_qk_l2norm_in_kernel=True)
    _, s = recurrent_kda(q, k, v, g, beta, initial_state=pool, state_indices=idx, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)
    assert s.shape == (3, 2, 32, 16) and rel(s, want) <= TOL
    before = pool.clone()
    o, s, states = recurrent_kda(q, k, v, g, beta, initial_state=pool, state_indices=idx, inplace_final_state=True,
                                 output_all_states=True, use_qk_l2norm_in_kernel=True)
    assert s is pool and rel(pool[idx], want) <= TOL and rel(o, o_ref) <= TOL
    assert torch.equal(pool[[1, 3]], before[[1, 3]]) and torch.equal(states[:, -1], pool[idx])
    with pytest.raises(ValueError, match="^state_indices"):
        recurrent_kda(q, k, v, g, beta, initial_state=pool, state_indices=torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError, match="^state_indices"):
        recurrent_kda(q, k, v, g, beta, initial_state=pool, state_indices=idx[:2])
    with pytest.raises(ValueError, match="^initial_state"):
        recurrent_kda(q, k, v, g, beta, initial_state=pool.double(), inplace_final_state=True,
                      state_indices=idx)
    with pytest.raises(ValueError, match="autograd"):
        recurrent_kda(q.requires_grad_(), k, v, g, beta)


def _grads(form, args, s0, proj, **kw):
    leaves = [x.detach().clone().requires_grad_() for x in (*args, s0)]
    o, s = form(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
    loss = (o * proj[0]).sum() + (s * proj[1]).sum()
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("gate", [1.0, 20.0], ids=["mild-decay", "steep-decay"])
def test_chunk_gradients_match_naive(gate):
    """fp64; the steep decay sends some 16-token blocks through the exact broadcast path."""
    args, s0 = inputs(1, 40, 1, 2, 16, 8, seed=6, gate=gate, dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    proj = (torch.randn(1, 40, 2, 8, generator=gen, dtype=torch.float64),
            torch.randn(1, 2, 16, 8, generator=gen, dtype=torch.float64))
    want = _grads(naive_kda, args, s0, proj, use_qk_l2norm_in_kernel=True)
    got = _grads(chunk_kda, args, s0, proj, use_qk_l2norm_in_kernel=True, chunk_size=32)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, want):
        assert rel(a, b) <= 1e-10, name


def _block_ranges(g: torch.Tensor) -> torch.Tensor:
    """Per-channel decay (nats) across each 16-token block, as intra.py's safety test sees it."""
    t = g.shape[1]
    return -g.double().reshape(g.shape[0], t // SUB_CHUNK, SUB_CHUNK, *g.shape[2:]).sum(2)


@pytest.mark.parametrize("form", [chunk_kda, recurrent_kda], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("case", ["g=0", "g=-1e4", "g=-inf", "beta=0", "zero-keys", "mixed-decay", "decay-at-limit"])
def test_edge_inputs(form, case):
    (q, k, v, g, beta), s0 = inputs(1, 128, 1, 2, 64, 32, seed=8)
    if case == "g=0":
        g = torch.zeros_like(g)
    elif case == "g=-1e4":
        g = torch.full_like(g, -1e4)
    elif case == "g=-inf":  # a full reset of some channels at a few tokens
        g[:, 7, :, :5] = g[:, 70, 1] = float("-inf")
    elif case == "beta=0":
        beta = torch.zeros_like(beta)
    elif case == "zero-keys":
        k = torch.zeros_like(k)
        k[:, 1::2] = torch.randn(1, 64, 1, 64)
    elif case == "mixed-decay":  # a few steep drops: some blocks safe, some recomputed exactly
        g = g * 0.2
        g[:, 5, :, :8] = -60.0
        g[:, 90:93, 1, 20:] = -1e4
    else:  # 3 nats per token on half the channels: 48 nats across a block, just under the limit
        g = g * 0.1
        g[..., ::2] = -3.0
    if case in ("mixed-decay", "decay-at-limit"):
        ranges = _block_ranges(g)
        assert bool((ranges > SAFE_EXPONENT).any()) == (case == "mixed-decay")
        assert bool((ranges <= SAFE_EXPONENT).any()) and float(ranges.max()) > 40
    o_ref, s_ref = reference((q, k, v, g, beta), s0, use_qk_l2norm_in_kernel=True)
    o, s = form(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel(o, o_ref) <= TOL and rel(s, s_ref) <= TOL


def test_intra_scores_against_broadcast():
    """P[i, j] = sum_k q_i k_j exp(G_i - G_j) (j <= i), A the same with k_i (j < i); the decays range
    from gentle to past the factorization's limit, and mix both within a block."""
    gen = torch.Generator().manual_seed(9)
    q, k = torch.randn(4, 64, 32, generator=gen), torch.randn(4, 64, 32, generator=gen)
    g = F.logsigmoid(torch.randn(4, 64, 32, generator=gen)) * torch.tensor([0.5, 4.0, 200.0, 1.0]).view(4, 1, 1)
    g[3, :, :4] *= 100  # a few fast-forgetting channels among gentle ones
    assert bool((-decay_factors(g).total > SAFE_EXPONENT).any()) and bool((-decay_factors(g).total < 20).any())
    sc = intra_scores(q, k, g)
    G = g.double().cumsum(1)
    d = G[..., :, None, :] - G[..., None, :, :]  # [.., i, j, K]
    mask = torch.ones(64, 64, dtype=torch.bool).tril()
    d = torch.where(mask[..., None], d, float("-inf")).exp()
    P_ref = (q[..., :, None, :] * k[..., None, :, :] * d).sum(-1)
    A_ref = (k[..., :, None, :] * k[..., None, :, :] * d).sum(-1).tril(-1)
    assert rel(sc.P, P_ref) <= TOL and rel(sc.A, A_ref) <= TOL


def test_unit_lower_inverse():
    gen = torch.Generator().manual_seed(10)
    k = F.normalize(torch.randn(4, 64, 16, generator=gen, dtype=torch.float64), dim=-1)
    k[1] = k[1, :1]  # one repeated key: a(k_i, k_j) = 1 everywhere (a Neumann series would struggle)
    A = (k @ k.transpose(-1, -2)).tril(-1) * torch.rand(4, 64, 1, generator=gen, dtype=torch.float64)
    want = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + A)
    assert rel(unit_lower_inverse(A.float()), want) <= TOL
    assert rel(unit_lower_inverse(A), want) <= 1e-12


def test_dtypes_and_defaults():
    (q, k, v, g, beta), _ = inputs(1, 20, 1, 1, 16, 16, seed=11, state=False)
    for form in (naive_kda, chunk_kda, recurrent_kda):
        o, s = form(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta)
        assert o.dtype == torch.bfloat16 and s is None
        _, s = form(q, k, v, g, beta, output_final_state=True)
        assert s.dtype == torch.float32 and s.shape == (1, 1, 16, 16)


@pytest.mark.parametrize("form", [chunk_kda, recurrent_kda, naive_kda], ids=["chunk", "recurrent", "naive"])
def test_argument_errors_name_the_argument(form):
    (q, k, v, g, beta), s0 = inputs(2, 8, 2, 4, 16, 8, seed=12)
    bad = [
        ("q", dict(q=q[0])),
        ("q", dict(q=q.long())),  # not floating
        ("k", dict(k=k[:, :, :1])),
        ("v", dict(v=v[:, :, :3])),
        ("g", dict(g=g[..., :8])),
        ("beta", dict(beta=beta[..., None])),
        ("initial_state", dict(initial_state=s0[:1])),
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 8]))),
    ]
    good = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0)
    for name, change in bad:
        kw = {**good, **change}
        with pytest.raises(ValueError, match=rf"^(with )?{name}\b"):
            form(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("g"), kw.pop("beta"), **kw)
    if form is chunk_kda:
        with pytest.raises(ValueError, match="^chunk_size"):
            form(q, k, v, g, beta, chunk_size=48)
        with pytest.raises(ValueError, match="^g must be <= 0"):
            form(q, k, v, -g, beta)


def test_recurrent_runs_on_the_shared_driver_workers(monkeypatch):
    """KDA decode is a step of the shared decode driver: big calls spread state blocks over worker
    threads (forced here on a small call), in-place pool updates and all states included."""
    from kvstate.ops import _threads

    monkeypatch.setattr(_threads, "MIN_WORK", 0)
    monkeypatch.setattr(_threads, "MAX_WORKERS", 3)  # as if on a 3-core machine
    calls, run = [], _threads.run
    monkeypatch.setattr(_threads, "run", lambda tasks: calls.append(len(tasks)) or run(tasks))
    lens = [0, 5, 1, 3]
    (q, k, v, g, beta), s0 = inputs(1, sum(lens), 2, 4, 16, 8, seed=21)
    s0 = torch.randn(4, 4, 16, 8)
    cu = torch.tensor([0] + lens).cumsum(0)
    o_ref, s_ref = naive_kda(*(x.double() for x in (q, k, v, g, beta)), initial_state=s0.double(),
                             output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    pool, idx = torch.randn(6, 4, 16, 8), torch.tensor([5, 0, 3, 1])
    pool[idx] = s0
    with torch.inference_mode():  # the engine decodes in inference mode; workers must inherit it
        o, final, al = recurrent_kda(q, k, v, g, beta, cu_seqlens=cu, initial_state=pool, state_indices=idx,
                                     inplace_final_state=True, output_all_states=True, use_qk_l2norm_in_kernel=True)
    assert final is pool and rel(o, o_ref) <= TOL and rel(pool[idx], s_ref) <= TOL
    assert torch.equal(al[0, -1], pool[1])  # the last token's state is the last sequence's final state
    assert calls == [3]  # the call ran on three workers


@pytest.mark.parametrize("block_bytes", [700, 5000])  # head ranges of one sequence / several sequences
@pytest.mark.parametrize("t", [1, 3])
def test_recurrent_state_blocks(monkeypatch, block_bytes, t):
    """The driver's blocks: a few heads of one sequence, or (one token each) several whole sequences."""
    from kvstate.ops import _recurrent_delta

    monkeypatch.setattr(_recurrent_delta, "BLOCK_BYTES", block_bytes)  # states are 4 x 16 x 8 x 4 B = 2 KiB
    args, s0 = inputs(5, t, 2, 4, 16, 8, seed=22)
    o_ref, s_ref = reference(args, s0, use_qk_l2norm_in_kernel=True)
    o, none = recurrent_kda(*args, initial_state=s0, use_qk_l2norm_in_kernel=True)  # no final state: scratch
    assert none is None and rel(o, o_ref) <= TOL
    state = s0.clone()
    o, s = recurrent_kda(*args, initial_state=state, inplace_final_state=True, use_qk_l2norm_in_kernel=True)
    assert s is state and rel(o, o_ref) <= TOL and rel(state, s_ref) <= TOL


def test_recurrent_reads_a_low_precision_state_pool():
    """A bf16 state pool is read block by block in fp32; the new state is fp32, the pool untouched."""
    args, s0 = inputs(3, 2, 1, 2, 16, 8, seed=23)
    idx = torch.tensor([1, 2, 0])
    pool = torch.empty_like(s0, dtype=torch.bfloat16)
    pool[idx] = s0.bfloat16()  # sequence n's state in row idx[n]
    o_ref, s_ref = reference(args, s0.bfloat16().float(), use_qk_l2norm_in_kernel=True)
    before = pool.clone()
    o, s = recurrent_kda(*args, initial_state=pool, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         state_indices=idx)
    assert s.dtype == torch.float32 and rel(o, o_ref) <= TOL and rel(s, s_ref) <= TOL
    assert torch.equal(pool, before)
