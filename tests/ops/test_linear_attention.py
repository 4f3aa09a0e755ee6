"""Linear attention and gated linear attention (scalar decay): fast forms against naive and the quadratic form.

The quadratic ("attention") form is written here from the definition, independently of the ops:
o_t = sum_{j <= t} e^{b_t - b_j} (scale q_t . k_j) v_j + e^{b_t} S0^T (scale q_t), b = cumsum(g).
Naive in fp64, fast forms in fp32, relative error <= 1e-5.
"""

import pytest
import torch
import torch.nn.functional as F

from kvstate.ops.gated_linear_attention import (chunk_gated_linear_attention, naive_gated_linear_attention,
                                                recurrent_gated_linear_attention)
from kvstate.ops.linear_attention import chunk_linear_attention, naive_linear_attention, recurrent_linear_attention


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make(b, t, h, hv, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(b, t, h, dk), k=r(b, t, h, dk), v=r(b, t, hv, dv), g=F.logsigmoid(r(b, t, hv) + 3.0),
                initial_state=0.5 * r(b, hv, dk, dv))


def f64(x):
    return {n: t.double() for n, t in x.items()}


def quadratic(q, k, v, g, s0, scale):
    """The causal attention form of (gated) linear attention, fp64."""
    q, k, v, s0 = q.double(), k.double(), v.double(), s0.double()
    rep = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(rep, 2) * scale, k.repeat_interleave(rep, 2)
    b = torch.zeros(v.shape[:3], dtype=torch.float64) if g is None else g.double().cumsum(1)  # [B, T, HV]
    t = q.shape[1]
    decay = (b.permute(0, 2, 1)[..., :, None] - b.permute(0, 2, 1)[..., None, :]).exp()  # [B, HV, T, T]
    scores = torch.einsum("bthk,bshk->bhts", q, k) * decay * torch.ones(t, t, dtype=torch.bool).tril()
    o = torch.einsum("bhts,bshv->bthv", scores, v)
    return o + torch.einsum("bthk,bhkv->bthv", q * b.exp()[..., None], s0)


SIZES = [(2, 1, 1, 48, 64), (1, 63, 2, 100, 48), (2, 65, 1, 64, 100), (1, 500, 1, 128, 128)]


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("b,t,h,dk,dv", SIZES)
def test_fast_forms_match_naive_and_quadratic(b, t, h, dk, dv, gated):
    x = make(b, t, h, 2 * h, dk, dv)
    if not gated:
        x.pop("g")
    naive = naive_gated_linear_attention if gated else naive_linear_attention
    o_ref, s_ref = naive(**f64(x), output_final_state=True)
    assert rel(o_ref, quadratic(x["q"], x["k"], x["v"], x.get("g"), x["initial_state"], dk**-0.5)) < 1e-10
    fns = (chunk_gated_linear_attention, recurrent_gated_linear_attention) if gated else \
        (chunk_linear_attention, recurrent_linear_attention)
    for fn in fns:
        o, s = fn(**x, output_final_state=True)
        assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5, fn.__name__


def test_l2norm_flag_scale_and_split_carry():
    x = make(2, 140, 2, 4, 32, 16, seed=1)
    kw = dict(use_qk_l2norm_in_kernel=True, scale=0.3)
    o_ref, s_ref = naive_gated_linear_attention(**f64(x), output_final_state=True, **kw)
    unit = dict(x, q=F.normalize(x["q"], dim=-1, eps=1e-30), k=F.normalize(x["k"], dim=-1, eps=1e-30))
    assert rel(o_ref, quadratic(unit["q"], unit["k"], x["v"], x["g"], x["initial_state"], 0.3)) < 1e-5
    for fn in (chunk_gated_linear_attention, recurrent_gated_linear_attention):
        state, outs = x["initial_state"], []
        for a, e in ((0, 5), (5, 133), (133, 140)):  # three uneven pieces
            piece = {n: x[n][:, a:e] for n in ("q", "k", "v", "g")}
            o, state = fn(**piece, initial_state=state, output_final_state=True, **kw)
            outs.append(o)
        assert rel(torch.cat(outs, 1), o_ref) <= 1e-5 and rel(state, s_ref) <= 1e-5, fn.__name__


@pytest.mark.parametrize("gated", [False, True])
def test_varlen_equals_separate_runs(gated):
    lens = [3, 0, 130, 64]
    parts = [make(1, n, 1, 2, 16, 24, seed=20 + i) for i, n in enumerate(lens)]
    names = ("q", "k", "v", "g") if gated else ("q", "k", "v")
    packed = {n: torch.cat([p[n] for p in parts], 1) for n in names}
    packed["initial_state"] = torch.cat([p["initial_state"] for p in parts])
    cu = torch.tensor([0] + lens).cumsum(0)
    fns = (chunk_gated_linear_attention, recurrent_gated_linear_attention) if gated else \
        (chunk_linear_attention, recurrent_linear_attention)
    for fn in fns:
        o, s = fn(**packed, cu_seqlens=cu, output_final_state=True)
        for i, p in enumerate(parts):
            args = {n: p[n].double() for n in (*names, "initial_state")}
            o_i, s_i = naive_gated_linear_attention(**{"g": None, **args}, output_final_state=True)
            if lens[i]:
                assert rel(o[:, cu[i]:cu[i + 1]], o_i) <= 1e-5
            assert rel(s[i], s_i[0]) <= 1e-5


def test_all_states_and_inplace():
    x = make(2, 3, 1, 2, 8, 4, seed=2)
    state = x["initial_state"].clone()
    o, final, all_states = recurrent_gated_linear_attention(**{**x, "initial_state": state}, output_all_states=True,
                                                            inplace_final_state=True)
    assert final is state
    for t in range(3):
        _, s_t = naive_gated_linear_attention(**{n: x[n][:, : t + 1] for n in ("q", "k", "v", "g")},
                                              initial_state=x["initial_state"], output_final_state=True)
        assert rel(all_states[:, t], s_t) <= 1e-6
    assert torch.equal(all_states[:, -1], state)


@pytest.mark.parametrize("gated", [False, True])
def test_gradients_match_naive(gated):
    x = f64(make(2, 19, 1, 2, 6, 5, seed=3))
    if not gated:
        x.pop("g")
    names = tuple(x)
    wo, ws = torch.randn(2, 19, 2, 5, dtype=torch.float64), torch.randn(2, 2, 6, 5, dtype=torch.float64)
    grads = []
    for fn, kw in ((naive_gated_linear_attention, {}), (chunk_gated_linear_attention, dict(chunk_size=8))):
        leaves = {n: x[n].clone().requires_grad_() for n in names}
        o, s = fn(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
        grads.append(torch.autograd.grad((o * wo).sum() + (s * ws).sum(), list(leaves.values())))
    for name, a, b in zip(names, *grads):
        assert rel(a, b) <= 1e-8, name


@pytest.mark.parametrize("case", ["g_zero", "g_huge_decay", "zero_keys"])
def test_edge_inputs_stay_finite(case):
    x = make(1, 70, 1, 2, 16, 8, seed=4)
    if case == "g_zero":
        x["g"] = torch.zeros_like(x["g"])
    elif case == "g_huge_decay":
        x["g"] = torch.full_like(x["g"], -1e4)
    else:
        x["k"] = torch.zeros_like(x["k"])
    o_ref, s_ref = naive_gated_linear_attention(**f64(x), output_final_state=True, use_qk_l2norm_in_kernel=True)
    for fn in (chunk_gated_linear_attention, recurrent_gated_linear_attention):
        o, s = fn(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5, fn.__name__
    if case == "g_huge_decay":  # nothing survives a token: o_t = (q_t . k_t) v_t, the state is the last write
        assert rel(s_ref[0], torch.einsum("hk,hv->hkv", F.normalize(x["k"][0, -1].double(), dim=-1).expand(2, -1),
                                          x["v"][0, -1].double())) < 1e-5


@pytest.mark.parametrize("fn", [naive_gated_linear_attention, chunk_gated_linear_attention,
                                recurrent_gated_linear_attention])
def test_bad_arguments_name_the_argument(fn):
    x = make(2, 4, 2, 4, 8, 8)
    for name, value in (("q", x["q"][0]), ("k", x["k"].int()), ("g", x["g"][:, :2]),
                        ("initial_state", x["initial_state"][:1])):
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            fn(**{**x, name: value})
