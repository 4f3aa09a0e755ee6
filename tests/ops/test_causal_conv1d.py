"""Causal depthwise conv1d: against F.conv1d and transformers' torch fallbacks (causal_conv1d_fn /
causal_conv1d_update), state carry, decode update == full, varlen == separate, W-1 vs W states."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F

from kvstate.ops.conv import causal_conv1d, causal_conv1d_update


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def reference(x, weight, bias, activation, state=None):
    """F.conv1d on the channel-first history [state's last W-1 columns ; x] -> (y [B, T, D], last W)."""
    b, t, d = x.shape
    w = weight.shape[1]
    if state is None:
        state = x.new_zeros(b, d, w)
    hist = torch.cat([state[..., state.shape[2] - (w - 1):] if w > 1 else state[..., :0], x.transpose(1, 2)], -1)
    y = F.conv1d(hist, weight[:, None, :], bias, groups=d).transpose(1, 2) if t else x * 0
    full = torch.cat([F.pad(state, (w - state.shape[2], 0)), x.transpose(1, 2)], -1)
    return (F.silu(y) if activation else y), full[..., -w:]


def make(b, t, d, w, seed=0, dtype=torch.float32, n_state=None):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, t, d, generator=g, dtype=dtype), torch.randn(d, w, generator=g, dtype=dtype),
            torch.randn(d, generator=g, dtype=dtype), torch.randn(n_state or b, d, w, generator=g, dtype=dtype))


@pytest.mark.parametrize("t,d,w,use_bias,activation", [
    (1, 48, 4, True, "silu"), (3, 100, 4, False, None), (63, 48, 2, True, None), (65, 100, 3, True, "silu"),
    (500, 128, 4, True, "swish"), (7, 64, 1, True, "silu"),
])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_conv1d_reference(t, d, w, use_bias, activation, with_state):
    x, weight, bias, state = make(2, t, d, w)
    bias = bias if use_bias else None
    state = state if with_state else None
    y, final = causal_conv1d(x, weight, bias, activation=activation, initial_state=state, output_final_state=True)
    y_ref, final_ref = reference(x, weight, bias, activation, state)
    assert rel(y, y_ref) <= 1e-6 and torch.equal(final, final_ref)


def test_matches_transformers_fallbacks():
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, causal_conv1d_update as hf_update
    x, weight, bias, state = make(2, 37, 48, 4, seed=1)
    y = causal_conv1d(x, weight, bias, activation="silu")[0]
    y_hf = causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation="silu").transpose(1, 2)
    assert rel(y, y_hf) <= 1e-6
    ours, theirs = state.clone(), state.clone()
    for t in range(3):  # single tokens, then two tokens at once
        y1 = causal_conv1d_update(x[:, t], ours, weight, bias, activation="silu")
        y1_hf = hf_update(x[:, t, :, None], theirs, weight, bias, activation="silu")[..., 0]
        assert rel(y1, y1_hf) <= 1e-6 and torch.equal(ours, theirs)
    y2 = causal_conv1d_update(x[:, 3:5], ours, weight, None, activation=None)
    y2_hf = hf_update(x[:, 3:5].transpose(1, 2), theirs, weight, None, activation=None).transpose(1, 2)
    assert rel(y2, y2_hf) <= 1e-6 and torch.equal(ours, theirs)


def test_split_and_carry():
    x, weight, bias, state = make(2, 64, 48, 4, seed=2)
    y_all, final_all = causal_conv1d(x, weight, bias, activation="silu", initial_state=state, output_final_state=True)
    ys, s = [], state
    for a, e in [(0, 1), (1, 3), (3, 3), (3, 64)]:  # pieces shorter than W-1, an empty one, the rest
        y, s = causal_conv1d(x[:, a:e], weight, bias, activation="silu", initial_state=s, output_final_state=True)
        ys.append(y)
    assert rel(torch.cat(ys, 1), y_all) <= 1e-6 and torch.equal(s, final_all)


@pytest.mark.parametrize("state_width", [4, 3, 6])
def test_update_equals_full(state_width):
    x, weight, bias, _ = make(3, 12, 100, 4, seed=3)
    y_all, _ = causal_conv1d(x, weight, bias, activation="silu")
    _, state = causal_conv1d(x[:, :5], weight, bias, output_final_state=True)
    conv_state = F.pad(state, (state_width - 4, 0)) if state_width >= 4 else state[..., 4 - state_width:].clone()
    ptr = conv_state.data_ptr()
    ys = [causal_conv1d_update(x[:, t], conv_state, weight, bias, activation="silu") for t in range(5, 9)]
    ys.append(causal_conv1d_update(x[:, 9:12], conv_state, weight, bias, activation="silu"))  # 3 tokens
    assert conv_state.data_ptr() == ptr  # updated in place
    assert rel(torch.cat([torch.stack(ys[:4], 1), ys[4]], 1), y_all[:, 5:]) <= 1e-6
    expect = F.pad(x.transpose(1, 2), (state_width, 0))[..., -state_width:]  # the last S inputs
    assert torch.equal(conv_state, expect)


def test_state_of_w_minus_1_columns_equals_w_columns():
    x, weight, bias, state = make(2, 6, 48, 4, seed=4)
    y_w, f_w = causal_conv1d(x, weight, bias, initial_state=state, output_final_state=True)
    y_w1, f_w1 = causal_conv1d(x, weight, bias, initial_state=state[..., 1:], output_final_state=True)
    assert torch.equal(y_w, y_w1) and torch.equal(f_w, f_w1)
    # the oldest column of a W-wide state is never read
    y_junk = causal_conv1d(x, weight, bias, initial_state=torch.cat([state[..., :1] + 5, state[..., 1:]], -1))[0]
    assert torch.equal(y_junk, y_w)
    short = causal_conv1d(x[:, :2], weight, bias, initial_state=state[..., 1:], output_final_state=True)[1]
    assert short.shape == (2, 48, 4) and torch.equal(short[..., 2:], x[:, :2].transpose(1, 2))


LENGTHS = [3, 0, 1, 9, 2, 40]


@pytest.mark.parametrize("with_state", [False, True])
def test_varlen_equals_separate(with_state):
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    x, weight, bias, state = make(1, sum(LENGTHS), 48, 4, seed=5, n_state=len(LENGTHS))
    state = state if with_state else None
    y, final = causal_conv1d(x, weight, bias, activation="silu", initial_state=state, output_final_state=True,
                             cu_seqlens=cu)
    for i, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        s_i = None if state is None else state[i : i + 1]
        y_i, f_i = reference(x[:, a:e], weight, bias, "silu", s_i)
        assert rel(y[:, a:e], y_i) <= 1e-6 if e > a else True
        assert torch.equal(final[i : i + 1], f_i)
    if state is not None:
        assert torch.equal(final[1], state[1])  # zero-length sequence: final = initial


def test_gradients_match_conv1d_reference():
    cu = torch.tensor([0, 5, 5, 6, 20])
    x, weight, bias, state = (t.double().requires_grad_() for t in make(1, 20, 12, 4, seed=6, n_state=4))
    y, final = causal_conv1d(x, weight, bias, activation="silu", initial_state=state, output_final_state=True,
                             cu_seqlens=cu)
    g = torch.Generator().manual_seed(7)
    w_y = torch.randn(y.shape, generator=g, dtype=torch.float64)
    w_f = torch.randn(final.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((y * w_y).sum() + (final * w_f).sum(), [x, weight, bias, state])
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    parts = [reference(x[:, a:e], weight, bias, "silu", state[i : i + 1]) for i, (a, e) in enumerate(bounds)]
    y_ref, f_ref = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 0)
    ref = torch.autograd.grad((y_ref * w_y).sum() + (f_ref * w_f).sum(), [x, weight, bias, state])
    for name, a, b in zip(["x", "weight", "bias", "initial_state"], grads, ref):
        assert rel(a, b) <= 1e-12, name


@pytest.mark.parametrize("tokens", [1, 3])
def test_update_under_autograd_gives_gradients_and_the_same_state(tokens):
    """Gradients reach x, weight and bias through y; the state is a cache written without history."""
    x, weight, bias, state = make(2, tokens, 12, 4, seed=9, dtype=torch.float64)
    leaves = [x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()]
    s = state.clone()
    y = causal_conv1d_update(x if tokens > 1 else x[:, 0], s, weight, bias, activation="silu")
    y_ref, s_ref = reference(x, weight, bias, "silu", state)
    assert not s.requires_grad and torch.equal(s, s_ref.detach())
    y = y if tokens > 1 else y[:, None]
    w_y = torch.randn(y.shape, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((y * w_y).sum(), leaves), torch.autograd.grad((y_ref * w_y).sum(), leaves)):
        assert rel(a, b) <= 1e-12


def test_dtypes_and_empty_batch():
    x, weight, bias, state = make(2, 9, 48, 4, seed=8)
    y, final = causal_conv1d(x.bfloat16(), weight, bias, activation="silu", output_final_state=True)
    assert y.dtype == torch.bfloat16 and final.dtype == torch.bfloat16
    assert rel(y, reference(x.bfloat16().float(), weight, bias, "silu")[0]) <= 1e-2
    y, final = causal_conv1d(x[:, :0], weight, bias, initial_state=state, output_final_state=True)
    assert y.shape == (2, 0, 48) and torch.equal(final, state)
    assert torch.isfinite(causal_conv1d(x * 1e30, weight, bias)[0]).all()


@pytest.mark.parametrize("name,call", [
    ("x", lambda x, w, b, s: causal_conv1d(x[0], w, b)),
    ("x", lambda x, w, b, s: causal_conv1d(x.long(), w, b)),
    ("weight", lambda x, w, b, s: causal_conv1d(x, w[:-1], b)),
    ("bias", lambda x, w, b, s: causal_conv1d(x, w, b[:-1])),
    ("activation", lambda x, w, b, s: causal_conv1d(x, w, b, activation="relu")),
    ("initial_state", lambda x, w, b, s: causal_conv1d(x, w, b, initial_state=s[..., :2])),
    ("initial_state", lambda x, w, b, s: causal_conv1d(x, w, b, initial_state=s[:1])),
    ("cu_seqlens", lambda x, w, b, s: causal_conv1d(x, w, b, cu_seqlens=torch.tensor([0, 9]))),
    ("conv_state", lambda x, w, b, s: causal_conv1d_update(x[:, 0], s[..., :2], w, b)),
    ("conv_state", lambda x, w, b, s: causal_conv1d_update(x[:, 0], s[:, :-1], w, b)),
    ("x", lambda x, w, b, s: causal_conv1d_update(x[0, 0], s, w, b)),
    ("weight", lambda x, w, b, s: causal_conv1d_update(x[:, 0], s, w[None], b)),
    ("activation", lambda x, w, b, s: causal_conv1d_update(x[:, 0], s, w, b, activation="gelu")),
])
def test_wrong_arguments_raise_value_error_naming_them(name, call):
    with pytest.raises(ValueError, match=name):
        call(*make(2, 9, 48, 4))
