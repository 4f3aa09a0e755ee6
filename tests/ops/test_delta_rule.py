"""Delta rule (no decay): chunk and recurrent forms against the naive loop and transformers with g = 0.

The delta rule takes the decay-free path of the gated kernels (no exponentials, shared masks), so
it is tested on its own. Naive in fp64, fast forms in fp32, relative error <= 1e-5.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from kvstate.ops.delta_rule import chunk_delta_rule, naive_delta_rule, recurrent_delta_rule

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make(b, t, h, hv, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(b, t, h, dk), k=r(b, t, h, dk), v=r(b, t, hv, dv), beta=torch.sigmoid(r(b, t, hv)),
                initial_state=0.5 * r(b, hv, dk, dv))


def f64(x):
    return {n: t.double() for n, t in x.items()}


SIZES = [(2, 1, 1, 64, 48), (1, 63, 2, 48, 100), (1, 65, 1, 128, 64), (1, 500, 1, 100, 128)]


@pytest.mark.parametrize("b,t,h,dk,dv", SIZES)
def test_chunk_and_recurrent_match_naive(b, t, h, dk, dv):
    x = make(b, t, h, 2 * h, dk, dv)
    o_ref, s_ref = naive_delta_rule(**f64(x), output_final_state=True, use_qk_l2norm_in_kernel=True)
    for fn in (chunk_delta_rule, recurrent_delta_rule):
        o, s = fn(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5, fn.__name__


def test_against_transformers_with_zero_decay():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    x = make(2, 70, 2, 4, 32, 16, seed=1)
    g = torch.zeros(2, 70, 4)
    o_ref, s_ref = torch_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g, x["beta"],
                                                    initial_state=x["initial_state"], output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    for fn in (naive_delta_rule, chunk_delta_rule, recurrent_delta_rule):
        o, s = fn(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5, fn.__name__


def test_split_carry_and_varlen():
    x = make(1, 150, 1, 2, 32, 24, seed=2)
    x["q"], x["k"] = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)  # flag off, keys already unit
    o_all, s_all = chunk_delta_rule(**x, output_final_state=True)
    state, outs = x["initial_state"], []
    for a, e in ((0, 64), (64, 65), (65, 150)):
        piece = {n: x[n][:, a:e] for n in ("q", "k", "v", "beta")}
        o, state = recurrent_delta_rule(**piece, initial_state=state, output_final_state=True)
        outs.append(o)
    assert rel(torch.cat(outs, 1), o_all) <= 1e-5 and rel(state, s_all) <= 1e-5
    # the same tokens as a packed batch of three sequences, each from a zero state
    cu = torch.tensor([0, 64, 65, 150])
    args = {n: x[n] for n in ("q", "k", "v", "beta")}
    o_p, s_p = chunk_delta_rule(**args, cu_seqlens=cu, output_final_state=True)
    for i in range(3):
        a, e = int(cu[i]), int(cu[i + 1])
        o_i, s_i = naive_delta_rule(**{n: t[:, a:e].double() for n, t in args.items()}, output_final_state=True)
        assert rel(o_p[:, a:e], o_i) <= 1e-5 and rel(s_p[i], s_i[0]) <= 1e-5


def test_gradients_match_naive():
    x = f64(make(2, 21, 1, 2, 8, 5, seed=3))
    names = tuple(x)
    wo, ws = torch.randn(2, 21, 2, 5, dtype=torch.float64), torch.randn(2, 2, 8, 5, dtype=torch.float64)
    grads = []
    for fn, kw in ((naive_delta_rule, {}), (chunk_delta_rule, dict(chunk_size=8))):
        leaves = {n: x[n].clone().requires_grad_() for n in names}
        o, s = fn(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
        grads.append(torch.autograd.grad((o * wo).sum() + (s * ws).sum(), list(leaves.values())))
    for name, a, b in zip(names, *grads):
        assert rel(a, b) <= 1e-8, name


def test_beta_zero_and_zero_keys_write_nothing():
    x = make(1, 66, 1, 2, 16, 8, seed=4)
    for change in ("beta", "k"):
        y = {**x, change: torch.zeros_like(x[change])}
        for fn in (chunk_delta_rule, recurrent_delta_rule):
            o, s = fn(**y, output_final_state=True, use_qk_l2norm_in_kernel=True)
            assert torch.isfinite(o).all() and torch.equal(s, x["initial_state"]), (change, fn.__name__)


@pytest.mark.parametrize("fn", [naive_delta_rule, chunk_delta_rule, recurrent_delta_rule])
def test_bad_arguments_name_the_argument(fn):
    x = make(1, 4, 2, 4, 8, 8)
    for name, value in (("beta", x["beta"][..., :1]), ("beta", None), ("v", x["v"][..., :3, :]),
                        ("initial_state", x["initial_state"].double()[..., :2])):
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            fn(**{**x, name: value})
