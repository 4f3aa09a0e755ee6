"""SSD (Mamba-2 scan): naive against transformers' Mamba2 torch path, fast forms against naive.

transformers' `mamba2_chunk_scan` (prefill) and `mamba2_selective_state_update` (decode) are the
independent reference; their state is [B, H, P, N], the transpose of ours [N_seq, H, N, P].
"""

import math
import os

import pytest
import torch
import torch.nn.functional as F

from kvstate.ops.ssd import chunk_ssd, naive_ssd, recurrent_ssd

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make(b, t, h, p, g, n, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return dict(x=r(b, t, h, p), dt=r(b, t, h) - 1.0, A=-torch.exp(r(h)), B=r(b, t, g, n), C=r(b, t, g, n),
                D=r(h), dt_bias=0.5 * r(h), initial_state=0.5 * r(b, h, n, p))


def f64(x):
    return {k: None if v is None else v.double() for k, v in x.items()}


def test_naive_matches_transformers_prefill_and_decode():
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan, mamba2_selective_state_update

    x = make(2, 70, 8, 16, 2, 32, seed=1)
    limit = (0.0, 1.5)  # clamps part of softplus(dt + dt_bias)
    y_hf, s_hf = mamba2_chunk_scan(x["x"], x["dt"], x["A"], x["B"], x["C"], chunk_size=16, D=x["D"],
                                   dt_bias=x["dt_bias"], dt_softplus=True, dt_limit=limit,
                                   initial_states=x["initial_state"].transpose(-1, -2), return_final_states=True)
    y, s = naive_ssd(**x, dt_softplus=True, dt_limit=limit, output_final_state=True)
    assert rel(y, y_hf) <= 1e-5 and rel(s.transpose(-1, -2), s_hf) <= 1e-5
    y_c, s_c = chunk_ssd(**x, dt_softplus=True, dt_limit=limit, output_final_state=True)
    assert rel(y_c, y_hf) <= 1e-5 and rel(s_c, s) <= 1e-5
    # one decode step, transformers' per-element API (dt, A, D expanded over head_dim and d_state)
    p, n = 16, 32  # head_dim, d_state
    state = x["initial_state"].transpose(-1, -2).contiguous()
    y_hf = mamba2_selective_state_update(state, x["x"][:, 0], x["dt"][:, 0, :, None].expand(-1, -1, p),
                                         x["A"][:, None, None].expand(-1, p, n), x["B"][:, 0], x["C"][:, 0],
                                         x["D"][:, None].expand(-1, p), dt_bias=x["dt_bias"][:, None].expand(-1, p),
                                         dt_softplus=True)
    step = {k: (v[:, :1] if k in ("x", "dt", "B", "C") else v) for k, v in x.items()}
    for fn in (naive_ssd, recurrent_ssd):
        y, s = fn(**step, dt_softplus=True, output_final_state=True)
        assert rel(y[:, 0], y_hf) <= 1e-5 and rel(s.transpose(-1, -2), state) <= 1e-5, fn.__name__


# every T in {1, 63, 65, 500}; d_state and head_dim over {48, 64, 100, 128}; heads = 2 x groups
SIZES = [(2, 1, 4, 48, 2, 64), (1, 63, 2, 100, 1, 128), (1, 65, 4, 64, 2, 100), (1, 500, 2, 128, 1, 48)]


@pytest.mark.parametrize("b,t,h,p,g,n", SIZES)
def test_fast_forms_match_naive(b, t, h, p, g, n):
    x = make(b, t, h, p, g, n)
    y_ref, s_ref = naive_ssd(**f64(x), dt_softplus=True, output_final_state=True)
    for fn in (chunk_ssd, recurrent_ssd):
        y, s = fn(**x, dt_softplus=True, output_final_state=True)
        assert y.dtype == torch.float32 and s.dtype == torch.float32
        assert rel(y, y_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5, fn.__name__


def test_per_channel_D_and_z_gate():
    x = make(1, 30, 4, 8, 2, 16, seed=2)
    d2, z = torch.randn(4, 8), torch.randn(1, 30, 4, 8)
    base = {k: v for k, v in x.items() if k != "D"}
    y0, _ = naive_ssd(**f64(base), dt_softplus=True)  # no D, no z: the scan alone
    expect = (y0 + x["x"].double() * d2.double()) * F.silu(z.double())  # mamba_ssm: (y + D x) * silu(z)
    for fn in (naive_ssd, chunk_ssd, recurrent_ssd):
        y, _ = fn(**base, D=d2, z=z, dt_softplus=True)
        assert rel(y, expect) <= 1e-5, fn.__name__


def test_split_carry_varlen_and_all_states():
    x = make(1, 100, 4, 8, 2, 16, seed=3)
    names = ("x", "dt", "B", "C")
    const = {k: x[k] for k in ("A", "D", "dt_bias")}
    y_all, s_all = chunk_ssd(**x, dt_softplus=True, output_final_state=True)
    state, outs = x["initial_state"], []
    for fn, (a, e) in zip((recurrent_ssd, chunk_ssd, chunk_ssd), ((0, 3), (3, 70), (70, 100))):
        y, state = fn(**{k: x[k][:, a:e] for k in names}, **const, initial_state=state, dt_softplus=True,
                      output_final_state=True)
        outs.append(y)
    assert rel(torch.cat(outs, 1), y_all) <= 1e-5 and rel(state, s_all) <= 1e-5
    cu = torch.tensor([0, 3, 3, 70, 100])
    s0 = torch.randn(4, 4, 16, 8)
    for fn in (chunk_ssd, recurrent_ssd):
        y, s = fn(**{k: x[k] for k in names}, **const, initial_state=s0, cu_seqlens=cu, dt_softplus=True,
                  output_final_state=True)
        for i in range(4):
            a, e = int(cu[i]), int(cu[i + 1])
            y_i, s_i = naive_ssd(**{k: x[k][:, a:e].double() for k in names}, **f64(const),
                                 initial_state=s0[i:i + 1].double(), dt_softplus=True, output_final_state=True)
            assert rel(s[i], s_i[0]) <= 1e-5 and (a == e or rel(y[:, a:e], y_i) <= 1e-5)
    _, _, al = recurrent_ssd(**{k: x[k][:, :3] for k in names}, **const, initial_state=x["initial_state"],
                             dt_softplus=True, output_all_states=True)
    _, s2 = naive_ssd(**{k: x[k][:, :2] for k in names}, **const, initial_state=x["initial_state"],
                      dt_softplus=True, output_final_state=True)
    assert al.shape == (1, 3, 4, 16, 8) and rel(al[:, 1], s2) <= 1e-6


def test_gradients_match_naive():
    x = f64(make(2, 19, 2, 3, 1, 4, seed=4))
    names = tuple(x)
    wy, ws = torch.randn(2, 19, 2, 3, dtype=torch.float64), torch.randn(2, 2, 4, 3, dtype=torch.float64)
    grads = []
    for fn, kw in ((naive_ssd, {}), (chunk_ssd, dict(chunk_size=8))):
        leaves = {k: x[k].clone().requires_grad_() for k in names}
        y, s = fn(**leaves, dt_softplus=True, output_final_state=True, **kw)
        grads.append(torch.autograd.grad((y * wy).sum() + (s * ws).sum(), list(leaves.values())))
    for name, a, b in zip(names, *grads):
        assert rel(a, b) <= 1e-8, name


def test_edge_dt_zero_and_huge():
    x = make(1, 70, 2, 4, 1, 8, seed=5)
    for dt, expect_state in ((torch.zeros(1, 70, 2), x["initial_state"]), (torch.full((1, 70, 2), 1e4), None)):
        args = {**x, "dt": dt, "dt_bias": None}
        y_ref, s_ref = naive_ssd(**f64(args), output_final_state=True)
        for fn in (chunk_ssd, recurrent_ssd):
            y, s = fn(**args, output_final_state=True)
            assert torch.isfinite(y).all() and torch.isfinite(s).all()
            assert rel(y, y_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5
        if expect_state is not None:  # dt = 0: no decay, no write
            assert torch.equal(s, expect_state)


@pytest.mark.parametrize("fn", [naive_ssd, chunk_ssd, recurrent_ssd])
def test_bad_arguments_name_the_argument(fn):
    x = make(1, 5, 4, 8, 2, 16)
    bad = (("x", x["x"][0]), ("dt", x["dt"][..., :2]), ("A", x["A"][:3]), ("B", torch.ones(1, 5, 3, 16)),
           ("C", x["C"][..., :8]), ("D", torch.ones(4, 3)), ("z", torch.ones(1, 5, 4)), ("dt_bias", x["dt_bias"][:1]),
           ("initial_state", x["initial_state"][..., :4]), ("x", x["x"].long()))
    for name, value in bad:
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            fn(**{**x, name: value})
    assert math.isinf(fn.__kwdefaults__["dt_limit"][1])
