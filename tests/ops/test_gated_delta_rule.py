"""Gated delta rule: chunk and recurrent forms against the naive loop and against transformers.

Reference precision: the naive form runs in fp64 on the same inputs, the fast forms in fp32, so
a relative error <= 1e-5 measures the fast forms' own error.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from kvstate.ops.gated_delta_rule import chunk_gated_delta_rule, naive_gated_delta_rule, recurrent_gated_delta_rule

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make(b, t, h, hv, dk, dv, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return dict(q=r(b, t, h, dk), k=r(b, t, h, dk), v=r(b, t, hv, dv), g=F.logsigmoid(r(b, t, hv) + 3.0),
                beta=torch.sigmoid(r(b, t, hv)), initial_state=0.5 * r(b, hv, dk, dv))


def f64(x):
    return {n: t.double() for n, t in x.items()}


def naive(x, **kw):
    kw.setdefault("use_qk_l2norm_in_kernel", True)
    return naive_gated_delta_rule(**x, output_final_state=True, **kw)


# every T in {1, 63, 65, 500} and every head dim in {48, 64, 100, 128}; value heads = 2 x key heads
SIZES = [(2, 1, 2, 48, 64), (1, 63, 1, 100, 48), (2, 65, 2, 64, 100), (1, 500, 1, 128, 128)]


@pytest.mark.parametrize("b,t,h,dk,dv", SIZES)
def test_chunk_and_recurrent_match_naive(b, t, h, dk, dv):
    x = make(b, t, h, 2 * h, dk, dv)
    o_ref, s_ref = naive(f64(x))
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = fn(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert o.dtype == torch.float32 and s.dtype == torch.float32
        assert rel(o, o_ref) <= 1e-5, fn.__name__
        assert rel(s, s_ref) <= 1e-5, fn.__name__


def test_against_transformers():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                              torch_recurrent_gated_delta_rule)

    x = make(2, 77, 2, 4, 32, 48, seed=1)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(initial_state=x["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = torch_recurrent_gated_delta_rule(*args, **kw)
    o_hf, s_hf = torch_chunk_gated_delta_rule(*args, **kw)
    assert rel(o_hf, o_ref) < 1e-5  # the two references agree with each other
    for fn in (naive_gated_delta_rule, chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = fn(*args, **kw)
        assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5, fn.__name__


def test_no_l2norm_flag_and_custom_scale():
    x = make(1, 40, 2, 4, 16, 8, seed=2)
    x["q"], x["k"] = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)
    o_ref, s_ref = naive(f64(x), use_qk_l2norm_in_kernel=False, scale=0.7)
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = fn(**x, output_final_state=True, scale=0.7)
        assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5


@pytest.mark.parametrize("fn", [naive_gated_delta_rule, chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_a_given_scale_matches_transformers(fn):
    # transformers takes no scale (it multiplies q by K^-0.5): without the L2 norm, q * scale * K^0.5
    # given to it is `scale` times q, an independent check of how every form applies a given scale
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    x = make(1, 40, 2, 4, 16, 8, seed=5)
    x["q"], x["k"] = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o_ref, s_ref = torch_recurrent_gated_delta_rule(x["q"] * (0.7 * 16**0.5), *args[1:],
                                                    initial_state=x["initial_state"], output_final_state=True)
    o, s = fn(*args, scale=0.7, initial_state=x["initial_state"], output_final_state=True)
    assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_split_and_carry(chunk_size):
    x = make(2, 130, 2, 4, 32, 16, seed=3)
    o_all, s_all = chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                          chunk_size=chunk_size)
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        state, outs = x["initial_state"], []
        for a, e in ((0, 17), (17, 81), (81, 130)):  # three uneven pieces
            piece = {n: x[n][:, a:e] for n in ("q", "k", "v", "g", "beta")}
            o, state = fn(**piece, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
            outs.append(o)
        assert rel(torch.cat(outs, 1), o_all) <= 1e-5 and rel(state, s_all) <= 1e-5, fn.__name__


def test_varlen_equals_separate_runs():
    lens = [0, 70, 1, 129, 0, 5]
    parts = [make(1, n, 2, 4, 24, 40, seed=10 + i) for i, n in enumerate(lens)]
    packed = {n: torch.cat([p[n] for p in parts], 1) for n in ("q", "k", "v", "g", "beta")}
    packed["initial_state"] = torch.cat([p["initial_state"] for p in parts])
    cu = torch.tensor([0] + lens).cumsum(0)
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = fn(**packed, cu_seqlens=cu, output_final_state=True, use_qk_l2norm_in_kernel=True)
        for i, p in enumerate(parts):
            o_i, s_i = naive(f64(p))
            if lens[i]:
                assert rel(o[:, cu[i]:cu[i + 1]], o_i) <= 1e-5
            assert rel(s[i], s_i[0]) <= 1e-5
            if lens[i] == 0:
                assert torch.equal(s[i], p["initial_state"][0])  # empty sequence: final = initial


def test_recurrent_equals_chunk_without_initial_state():
    x = make(3, 40, 1, 2, 64, 32, seed=4)
    del x["initial_state"]
    o_c, s_c = chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_r, s_r = recurrent_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel(o_r, o_c) <= 1e-5 and rel(s_r, s_c) <= 1e-5


def test_all_states_and_inplace_pool():
    x = make(3, 5, 2, 4, 16, 8, seed=5)
    _, s_ref = naive(x)
    pool = torch.randn(6, 4, 16, 8)
    idx = torch.tensor([4, 0, 2])
    pool[idx] = x["initial_state"]
    untouched = pool[[1, 3, 5]].clone()
    args = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    o, final, all_states = recurrent_gated_delta_rule(**args, initial_state=pool, state_indices=idx,
                                                      inplace_final_state=True, output_all_states=True,
                                                      use_qk_l2norm_in_kernel=True)
    assert final is pool and all_states.shape == (3, 5, 4, 16, 8)
    assert rel(pool[idx], s_ref) <= 1e-5 and torch.equal(pool[[1, 3, 5]], untouched)
    for t in range(5):  # the state after token t is the final state of the first t + 1 tokens
        _, s_t = naive({**{n: a[:, : t + 1] for n, a in args.items()}, "initial_state": x["initial_state"]})
        assert rel(all_states[:, t], s_t) <= 1e-5
    # packed: all_states is [1, sum T, HV, K, V]
    cu = torch.tensor([0, 2, 2, 5])
    packed = {n: a[:1, :5] for n, a in args.items()}
    o, s, al = recurrent_gated_delta_rule(**packed, cu_seqlens=cu, output_all_states=True, output_final_state=True)
    assert al.shape == (1, 5, 4, 16, 8) and torch.equal(al[0, 1], s[0]) and torch.equal(al[0, 4], s[2])
    assert not s[1].any()  # empty sequence without initial state: zeros


def test_gradients_match_naive():
    x = f64(make(1, 37, 1, 2, 8, 6, seed=6))
    cu = torch.tensor([0, 20, 20, 37])
    x["initial_state"] = x["initial_state"].expand(3, -1, -1, -1).contiguous()
    names = ("q", "k", "v", "g", "beta", "initial_state")
    wo, ws = torch.randn(1, 37, 2, 6, dtype=torch.float64), torch.randn(3, 2, 8, 6, dtype=torch.float64)
    grads = []
    for fn in (naive_gated_delta_rule, chunk_gated_delta_rule):
        leaves = {n: x[n].clone().requires_grad_() for n in names}
        kw = dict(chunk_size=8) if fn is chunk_gated_delta_rule else {}
        o, s = fn(**leaves, cu_seqlens=cu, output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
        grads.append(torch.autograd.grad((o * wo).sum() + (s * ws).sum(), [leaves[n] for n in names]))
    for name, a, b in zip(names, *grads):
        assert rel(a, b) <= 1e-8, name


@pytest.mark.parametrize("case", ["g_zero", "g_huge_decay", "beta_zero", "zero_keys"])
def test_edge_inputs_stay_finite(case):
    x = make(2, 70, 1, 2, 16, 8, seed=7)
    if case == "g_zero":
        x["g"] = torch.zeros_like(x["g"])
    elif case == "g_huge_decay":
        x["g"] = torch.full_like(x["g"], -1e4)
    elif case == "beta_zero":
        x["beta"] = torch.zeros_like(x["beta"])
    else:
        x["k"] = torch.zeros_like(x["k"])
    o_ref, s_ref = naive(f64(x))
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = fn(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5
    if case in ("beta_zero", "zero_keys"):  # nothing is written: the state only decays
        decay = x["g"].double().sum(1).exp()[..., None, None]
        assert rel(s_ref, x["initial_state"] * decay) <= 1e-12


@pytest.mark.parametrize("fn", [naive_gated_delta_rule, chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_bad_arguments_name_the_argument(fn):
    x = make(2, 5, 2, 4, 8, 8)
    bad = [("q", x["q"][0]), ("k", x["k"][:, :, :1]), ("v", x["v"][:, :, :3]), ("g", x["g"][..., :1]),
           ("beta", None), ("beta", x["beta"].long()), ("initial_state", x["initial_state"][:, :1]),
           ("q", x["q"].long())]
    for name, value in bad:
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            fn(**{**x, name: value})
    with pytest.raises(ValueError, match="cu_seqlens"):
        fn(**x, cu_seqlens=torch.tensor([0, 5]))  # packed batches have B = 1


@pytest.mark.parametrize("chunk_size", [1, 64])
def test_inputs_are_not_modified(chunk_size):
    x = make(1, 9, 1, 2, 8, 4, seed=8)  # one key head: the chunk gather of q, k is a plain copy
    before = {n: t.clone() for n, t in x.items()}
    for fn, kw in ((chunk_gated_delta_rule, dict(chunk_size=chunk_size)), (recurrent_gated_delta_rule, {})):
        o, s = fn(**x, output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
        assert rel(o, naive(f64(x))[0]) <= 1e-5
        for n, t in x.items():
            assert torch.equal(t, before[n]), (fn.__name__, n)


def test_parallel_split_matches_naive(monkeypatch):
    """Big calls split key-head groups / state blocks over worker threads: force it on a small call."""
    from kvstate.ops import _threads

    monkeypatch.setattr(_threads, "MIN_WORK", 0)
    monkeypatch.setattr(_threads, "MAX_WORKERS", 3)  # as if on a 3-core machine
    threads = torch.get_num_threads()
    calls, run = [], _threads.run
    monkeypatch.setattr(_threads, "run", lambda tasks: calls.append(len(tasks)) or run(tasks))
    lens = [0, 70, 1, 129]
    x = make(1, sum(lens), 3, 6, 16, 8, seed=9)
    x["initial_state"] = torch.randn(4, 6, 16, 8)
    cu = torch.tensor([0] + lens).cumsum(0)
    o_ref, s_ref = naive(f64(x), cu_seqlens=cu)
    o, s = chunk_gated_delta_rule(**x, cu_seqlens=cu, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5
    pool = torch.randn(5, 6, 16, 8)
    idx = torch.tensor([3, 0, 4, 1])
    pool[idx] = x["initial_state"]
    args = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    with torch.inference_mode():  # the engine decodes in inference mode; workers must inherit it
        o, final, al = recurrent_gated_delta_rule(**args, cu_seqlens=cu, initial_state=pool, state_indices=idx,
                                                  inplace_final_state=True, output_all_states=True,
                                                  use_qk_l2norm_in_kernel=True)
    assert rel(o, o_ref) <= 1e-5 and rel(pool[idx], s_ref) <= 1e-5 and torch.equal(al[0, -1], pool[1])
    # equal lengths: the chunk layout is the identity and each worker carries its head slice of the
    # final-state buffer, which is not contiguous across sequences (a packed engine prefill)
    eq = make(1, 3 * 40, 3, 6, 16, 8, seed=10)
    eq["initial_state"] = torch.randn(3, 6, 16, 8)
    cu = torch.tensor([0, 40, 80, 120])
    o_ref, s_ref = naive(f64(eq), cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    with torch.inference_mode():
        o, s = chunk_gated_delta_rule(**eq, cu_seqlens=cu, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5
    assert calls == [3, 3, 3]  # every call ran on three workers
    assert torch.get_num_threads() == threads  # the caller's setting is restored


def test_bf16_inputs_compute_in_fp32():
    x = make(2, 40, 2, 4, 32, 16, seed=11)
    xb = {n: t.bfloat16() for n, t in x.items()}
    o_ref, s_ref = naive({n: t.double() for n, t in xb.items()})  # the same (rounded) inputs, fp64
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = fn(**xb, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
        assert rel(s, s_ref) <= 1e-5  # fp32 accumulation: only the output is rounded to bf16
        assert rel(o, o_ref) <= 1e-2


@pytest.mark.parametrize("block_bytes", [700, 5000])  # head ranges of one sequence / several sequences
@pytest.mark.parametrize("t", [1, 3])
def test_recurrent_state_blocks(monkeypatch, block_bytes, t):
    from kvstate.ops import _recurrent_delta

    monkeypatch.setattr(_recurrent_delta, "BLOCK_BYTES", block_bytes)  # states are 4 x 16 x 8 x 4 B = 2 KiB
    x = make(5, t, 2, 4, 16, 8, seed=12)
    o_ref, s_ref = naive(f64(x))
    o, none = recurrent_gated_delta_rule(**x, use_qk_l2norm_in_kernel=True)  # no final state: scratch blocks
    assert none is None and rel(o, o_ref) <= 1e-5
    state = x["initial_state"].clone()
    o, s = recurrent_gated_delta_rule(**{**x, "initial_state": state}, inplace_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
    assert s is state and rel(o, o_ref) <= 1e-5 and rel(state, s_ref) <= 1e-5
