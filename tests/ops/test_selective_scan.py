"""Mamba-1 selective scan: chunk and recurrent forms against the naive form (fp64) and against
transformers' own Mamba/Jamba slow path (its functions and a tiny JambaMambaMixer)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from kvstate.ops.selective_scan import chunk_selective_scan, naive_selective_scan, recurrent_selective_scan

FAST = {"chunk": chunk_selective_scan, "recurrent": recurrent_selective_scan}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(b, t, d, n, *, groups=None, dtype=torch.float64, seed=0, n_seq=None):
    """Inputs shaped like a Mamba layer's: A = -exp(A_log) < 0, dt = softplus(delta + bias)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    bc = (b, t, n) if groups is None else (b, t, groups, n)
    args = (r(b, t, d), r(b, t, d), -torch.exp(r(d, n) * 0.5), r(*bc), r(*bc))
    kw = dict(D=r(d), z=r(b, t, d), delta_bias=r(d) - 1, delta_softplus=True,
              initial_state=r(n_seq or b, d, n) * 0.5, output_final_state=True)
    return args, kw


def as32(args, kw):
    f = lambda v: v.float() if torch.is_tensor(v) and v.is_floating_point() else v  # noqa: E731
    return tuple(f(a) for a in args), {k: f(v) for k, v in kw.items()}


# (T, D, N, groups, chunk_size): every T in {1, 63, 65, 500}, D in {48, 100, 128}, N in {16, 64}
SIZES = [(1, 48, 16, None, None), (63, 100, 64, None, None), (65, 128, 16, None, None),
         (500, 48, 16, None, None), (65, 100, 16, None, 16), (63, 128, 16, 4, 7)]


@pytest.mark.parametrize("form", FAST)
@pytest.mark.parametrize("t,d,n,groups,chunk", SIZES)
def test_fast_matches_naive(form, t, d, n, groups, chunk):
    args, kw = make(2, t, d, n, groups=groups)
    y_ref, h_ref = naive_selective_scan(*args, **kw)  # fp64: the truth
    args32, kw32 = as32(args, kw)
    if chunk is not None and form == "chunk":
        kw32["chunk_size"] = chunk
    y, h = FAST[form](*args32, **kw32)
    assert y.dtype == torch.float32 and h.dtype == torch.float32
    assert rel(y, y_ref) <= 1e-5 and rel(h, h_ref) <= 1e-5


@pytest.mark.parametrize("form", FAST)
def test_plain_recurrence_without_options(form):
    """No bias, no softplus, no D, no z, no initial state: only the bare recurrence."""
    args, _ = make(1, 40, 48, 16)
    args = (args[0], torch.rand_like(args[1]), *args[2:])  # dt >= 0 given directly
    y_ref, h_ref = naive_selective_scan(*args, output_final_state=True)
    y, h = FAST[form](*as32(args, {})[0], output_final_state=True)
    assert rel(y, y_ref) <= 1e-5 and rel(h, h_ref) <= 1e-5
    assert FAST[form](*as32(args, {})[0])[1] is None


@pytest.mark.parametrize("form", FAST)
def test_split_and_carry(form):
    args, kw = as32(*make(2, 65, 100, 16, seed=1))
    y_all, h_all = FAST[form](*args, **kw)
    ys, h = [], kw["initial_state"]
    for s, e in [(0, 20), (20, 21), (21, 65)]:  # three uneven pieces
        piece = [a if a.dim() == 2 else a[:, s:e] for a in args]  # A [D, N] is not per token
        y, h = FAST[form](*piece, **{**kw, "z": kw["z"][:, s:e], "initial_state": h})
        ys.append(y)
    assert rel(torch.cat(ys, 1), y_all) <= 1e-6 and rel(h, h_all) <= 1e-6


def test_recurrent_equals_chunk():
    args, kw = as32(*make(3, 9, 128, 16, groups=2, seed=2))
    h0 = kw["initial_state"].clone()
    y_c, h_c = chunk_selective_scan(*args, **kw)
    y_r, h_r, states = recurrent_selective_scan(*args, **kw, output_all_states=True)
    y_r2, h_r2 = recurrent_selective_scan(*args, **kw)  # ping-pong buffers instead of all_states
    assert torch.equal(kw["initial_state"], h0)  # read, never written
    assert torch.equal(y_r2, y_r) and torch.equal(h_r2, h_r)
    assert rel(y_r, y_c) <= 1e-6 and rel(h_r, h_c) <= 1e-6
    assert states.shape == (3, 9, 128, 16)
    assert torch.equal(states[:, -1], h_r)
    y_part, h_part = chunk_selective_scan(*[a if a.dim() == 2 else a[:, :4] for a in args],
                                          **{**kw, "z": kw["z"][:, :4]})
    assert rel(states[:, 3], h_part) <= 1e-6  # the state after token 4


@pytest.mark.parametrize("budget,group,block", [(100, 1, 1), (2 * 768, 2, 1), (3 * 768 * 4, 3, 4)])
def test_small_cache_budget_splits_sequences_and_blocks(monkeypatch, budget, group, block):
    """Small buffer budgets: blocks of fewer sequences and fewer tokens (what large shapes get)."""
    import kvstate.ops.selective_scan.inputs as inputs
    import kvstate.ops.selective_scan.recurrent as recurrent
    from kvstate.ops._layout import scan_layout

    monkeypatch.setattr(inputs, "BUDGET", budget)
    monkeypatch.setattr(recurrent, "BUDGET", budget)
    blocks = scan_layout([12, 12, 12], [0, 12, 24], 48 * 16, budget, inputs.MAX_BLOCK).blocks
    assert max(b.seqs for b in blocks) == group and max(b.length for b in blocks) == block
    args, kw = make(3, 12, 48, 16, groups=2, seed=14)
    y_ref, h_ref = naive_selective_scan(*args, **kw)
    for fn in FAST.values():
        y, h = fn(*as32(args, kw)[0], **as32(args, kw)[1])
        assert rel(y, y_ref) <= 1e-5 and rel(h, h_ref) <= 1e-5
    args[1].requires_grad_()
    grads = []
    for fn in (naive_selective_scan, chunk_selective_scan):  # fp64 grads through the small blocks
        y, h = fn(*args, **kw)
        grads += torch.autograd.grad((y.square().sum() + h.sum()), [args[1]])
    assert rel(grads[1], grads[0]) <= 1e-10


LENGTHS = [5, 0, 70, 1, 33]


@pytest.mark.parametrize("form", FAST)
@pytest.mark.parametrize("chunk", [None, 8])
def test_varlen_equals_separate(form, chunk):
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    total, d, n = sum(LENGTHS), 48, 16
    args, kw = make(1, total, d, n, n_seq=len(LENGTHS), seed=3)
    args32, kw32 = as32(args, kw)
    extra = {"chunk_size": chunk} if form == "chunk" and chunk else {}
    if form == "recurrent":
        extra = {"output_all_states": True}
    out = FAST[form](*args32, **kw32, cu_seqlens=cu, **extra)
    y, h = out[0], out[1]
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        piece = [a if a.dim() == 2 else a[:, s:e] for a in args]
        y_i, h_i = naive_selective_scan(*piece, **{**kw, "z": kw["z"][:, s:e],
                                                   "initial_state": kw["initial_state"][i : i + 1]})
        if e > s:
            assert rel(y[:, s:e], y_i) <= 1e-5
        else:
            assert torch.equal(h[i], kw32["initial_state"][i])  # zero-length: final = initial
        assert rel(h[i : i + 1], h_i) <= 1e-5
    if form == "recurrent":
        states = out[2]
        assert states.shape == (1, total, d, n)
        assert torch.equal(states[0, cu[1:][torch.tensor(LENGTHS) > 0] - 1], h[torch.tensor(LENGTHS) > 0])


def test_varlen_equal_lengths_equals_batch():
    args, kw = as32(*make(3, 17, 48, 16, seed=4))
    y_b, h_b = chunk_selective_scan(*args, **kw)
    packed = [a if a.dim() == 2 else a.reshape(1, 3 * 17, *a.shape[2:]) for a in args]
    y_p, h_p = chunk_selective_scan(*packed, **{**kw, "z": kw["z"].reshape(1, 51, 48)},
                                    cu_seqlens=torch.tensor([0, 17, 34, 51]))
    assert rel(y_p.view(3, 17, 48), y_b) <= 1e-6 and rel(h_p, h_b) <= 1e-6


# ---- gradients of the chunk form (its own backward) against autograd through the naive form ----

@pytest.mark.parametrize("lengths,groups,chunk", [(None, None, 8), (None, 3, None), ([7, 0, 20, 3], None, 4)])
def test_chunk_gradients_match_naive(lengths, groups, chunk):
    b, t = (2, 37) if lengths is None else (1, sum(lengths))
    n_seq = b if lengths is None else len(lengths)
    cu = None if lengths is None else torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    args, kw = make(b, t, 12, 5, groups=groups, n_seq=n_seq, seed=5)
    options = ("D", "z", "delta_bias", "initial_state")
    leaves = [a.requires_grad_() for a in args] + [kw[k].requires_grad_() for k in options]
    g = torch.Generator().manual_seed(6)
    w_y = torch.randn(b, t, 12, generator=g, dtype=torch.float64)
    w_h = torch.randn(n_seq, 12, 5, generator=g, dtype=torch.float64)
    grads = []
    for fn, extra in ((naive_selective_scan, {}), (chunk_selective_scan, {"chunk_size": chunk})):
        y, h = fn(*args, **kw, cu_seqlens=cu, **extra)
        grads.append(torch.autograd.grad((y * w_y).sum() + (h * w_h).sum(), leaves))
    for name, g_ref, g_fast in zip(["u", "delta", "A", "B", "C", "D", "z", "delta_bias", "h0"], *grads):
        assert rel(g_fast, g_ref) <= 1e-10, name


def test_recurrent_is_differentiable_when_autograd_records():
    """Inputs that require grad take the out-of-place path: same values, gradients of naive's."""
    args, kw = make(2, 5, 12, 5, groups=3, seed=15)
    leaves = [a.requires_grad_() for a in args] + [kw["initial_state"].requires_grad_()]
    y, h, states = recurrent_selective_scan(*args, **kw, output_all_states=True)
    partial = naive_selective_scan(*[a if a.dim() == 2 else a[:, :3] for a in args], **{**kw, "z": kw["z"][:, :3]})[1]
    assert rel(states[:, 2], partial) <= 1e-12 and torch.equal(states[:, -1], h)
    grads = []
    for fn in (naive_selective_scan, recurrent_selective_scan):
        y, h = fn(*args, **kw)
        grads.append(torch.autograd.grad(y.square().sum() + h.sum(), leaves))
    for g_ref, g in zip(*grads):
        assert rel(g, g_ref) <= 1e-12


def test_chunk_gradients_fp32_and_final_state_only():
    args, kw = as32(*make(1, 50, 48, 16, seed=7))
    kw.pop("z")
    A = args[2].requires_grad_()
    grads = []
    for fn in (naive_selective_scan, chunk_selective_scan):
        _, h = fn(*args, **kw)
        grads.append(torch.autograd.grad(h.square().sum(), [A])[0])
    assert rel(grads[1], grads[0]) <= 1e-5


# ---- edge inputs: no NaN/inf, exact carries ----

@pytest.mark.parametrize("form", ["chunk", "recurrent", "naive"])
def test_edge_inputs(form):
    fn = {**FAST, "naive": naive_selective_scan}[form]
    args, kw = as32(*make(2, 30, 48, 16, seed=8))
    u, delta, A, B, C = args
    # huge decay: dt = 1e4 -> exp(dt A) underflows to 0, the state is just the last write
    y, h = fn(u, torch.full_like(delta, 1e4), A, B, C, **kw)
    assert torch.isfinite(y).all() and torch.isfinite(h).all()
    ref = (1e4 + kw["delta_bias"])[:, None] * u[:, -1, :, None] * B[:, -1, None, :]  # softplus(1e4 + b)
    assert rel(h, ref) <= 1e-6
    # dt = softplus(-1e4) = 0: nothing is written, nothing decays, the state is carried exactly
    y, h = fn(u, torch.full_like(delta, -1e4), A, B, C, **{**kw, "delta_bias": None})
    assert torch.equal(h, kw["initial_state"])
    # A = 0 (no decay), zero inputs: finite, state = initial + sum of writes
    y, h = fn(torch.zeros_like(u), delta, torch.zeros_like(A), B, C, **kw)
    assert torch.equal(h, kw["initial_state"]) and torch.isfinite(y).all()


def test_chunk_gradients_finite_under_huge_decay():
    args, kw = as32(*make(1, 20, 48, 16, seed=9))
    leaves = [a.requires_grad_() for a in args]
    delta = torch.full_like(args[1], 1e4).requires_grad_()
    y, h = chunk_selective_scan(args[0], delta, *args[2:], **kw, chunk_size=6)
    grads = torch.autograd.grad(y.sum() + h.sum(), [leaves[0], delta, *leaves[2:]])
    assert all(torch.isfinite(g).all() for g in grads)


def test_low_precision_inputs_keep_dtype_and_fp32_state():
    args, kw = make(1, 10, 48, 16, seed=10)
    args16 = tuple(a.bfloat16() for a in args)
    kw16 = {k: (v.bfloat16() if torch.is_tensor(v) else v) for k, v in kw.items()}
    kw64 = {k: (v.double() if torch.is_tensor(v) else v) for k, v in kw16.items()}
    y_ref, h_ref = naive_selective_scan(*(a.double() for a in args16), **kw64)
    for fn in FAST.values():
        y, h = fn(*args16, **kw16)
        assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
        assert rel(h, h_ref) <= 1e-5 and rel(y, y_ref) <= 1e-2  # y rounded to bf16


@pytest.mark.parametrize("form", ["chunk", "recurrent", "naive"])
@pytest.mark.parametrize("name,bad", [
    ("u", lambda a, k: ((a[0].long(),) + a[1:], k)),
    ("delta", lambda a, k: ((a[0], a[1][:, :-1]) + a[2:], k)),
    ("A", lambda a, k: (a[:2] + (a[2][:, None],) + a[3:], k)),
    ("B", lambda a, k: (a[:3] + (a[3][..., :-1],) + a[4:], k)),
    ("B", lambda a, k: (a[:3] + (a[3].view(2, 8, 16, 1).expand(2, 8, 16, 16)[:, :, :5],) + a[4:], k)),
    ("C", lambda a, k: (a[:4] + (a[4][:, :, None],), k)),
    ("D", lambda a, k: (a, {**k, "D": k["D"][:-1]})),
    ("z", lambda a, k: (a, {**k, "z": k["z"][0]})),
    ("delta_bias", lambda a, k: (a, {**k, "delta_bias": k["delta_bias"][None]})),
    ("initial_state", lambda a, k: (a, {**k, "initial_state": k["initial_state"][:1]})),
    ("cu_seqlens", lambda a, k: (a, {**k, "cu_seqlens": torch.tensor([0, 8])})),
])
def test_wrong_arguments_raise_value_error_naming_them(form, name, bad):
    fn = {**FAST, "naive": naive_selective_scan}[form]
    args, kw = bad(*as32(*make(2, 8, 48, 16)))
    with pytest.raises(ValueError, match=name):
        fn(*args, **kw)


# ---- transformers' Mamba/Jamba slow path: its functions and a tiny JambaMambaMixer ----

def test_matches_transformers_scan_functions():
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan, mamba_selective_state_update
    args, kw = as32(*make(2, 33, 48, 16, seed=11))
    u, delta, A, B, C = args
    kw.pop("initial_state")  # transformers' scan always starts from zeros
    y_hf, h_hf = mamba_selective_scan(u.transpose(1, 2), delta.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2),
                                      D=kw["D"], z=kw["z"].transpose(1, 2), delta_bias=kw["delta_bias"],
                                      delta_softplus=True, return_last_state=True)
    for fn in FAST.values():
        y, h = fn(*args, **kw)
        assert rel(y, y_hf.transpose(1, 2)) <= 1e-5 and rel(h, h_hf) <= 1e-5
    state = h_hf.clone()  # one decode step: transformers updates its state in place
    y1_hf = mamba_selective_state_update(state, u[:, 0], delta[:, 0], A, B[:, 0], C[:, 0], kw["D"], z=kw["z"][:, 0],
                                         dt_bias=kw["delta_bias"], dt_softplus=True)
    y1, h1 = recurrent_selective_scan(u[:, :1], delta[:, :1], A, B[:, :1], C[:, :1], **{**kw, "z": kw["z"][:, :1]},
                                      initial_state=h_hf)
    assert rel(y1[:, 0], y1_hf) <= 1e-6 and rel(h1, state) <= 1e-6


def _jamba_mixer():
    from transformers import JambaConfig
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer
    cfg = JambaConfig(hidden_size=24, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=6,
                      num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                      num_experts=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=32, intermediate_size=32)
    torch.manual_seed(12)
    mixer = JambaMambaMixer(cfg, layer_idx=0).eval()
    with torch.no_grad():  # move A, D, the conv and dt away from their init values
        mixer.A_log.add_(torch.randn_like(mixer.A_log) * 0.3)
        mixer.D.normal_()
        mixer.dt_proj.bias.normal_(-2.0, 1.0)
    return cfg, mixer


def _ours(m, hidden, conv_state=None, ssm_state=None):
    """The JambaMambaMixer forward written with kvstate's ops (its projections and norms reused)."""
    from kvstate.ops.conv import causal_conv1d, causal_conv1d_update
    inner = m.intermediate_size
    xbc, gate = m.in_proj(hidden).split(inner, dim=-1)  # [b, T, I] each
    weight = m.conv1d.weight.squeeze(1)
    if conv_state is not None:  # one cached decode step
        xbc = causal_conv1d_update(xbc[:, 0], conv_state, weight, m.conv1d.bias, activation="silu")[:, None]
        new_conv = conv_state
    else:
        xbc, new_conv = causal_conv1d(xbc, weight, m.conv1d.bias, activation="silu", output_final_state=True)
    ts, B, C = m.x_proj(xbc).split([m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1)
    delta = m.dt_layernorm(ts) @ m.dt_proj.weight.T  # [b, T, I], the bias goes to the scan
    scan = recurrent_selective_scan if ssm_state is not None else chunk_selective_scan
    y, h = scan(xbc, delta, -torch.exp(m.A_log.float()), m.b_layernorm(B), m.c_layernorm(C), D=m.D, z=gate,
                delta_bias=m.dt_proj.bias, delta_softplus=True, initial_state=ssm_state, output_final_state=True)
    return m.out_proj(y), new_conv, h


def test_matches_transformers_jamba_mixer_prefill_and_cached_decode():
    from transformers import DynamicCache
    cfg, mixer = _jamba_mixer()
    hidden = torch.randn(2, 21, 24, generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        y_hf = mixer(hidden)
        cache = DynamicCache(config=cfg)
        y_pre_hf = mixer(hidden[:, :20], cache=cache)
        conv_hf = cache.layers[0].conv_states[0].clone()
        ssm_hf = cache.layers[0].recurrent_states[0].clone()
        y_dec_hf = mixer(hidden[:, 20:], cache=cache)
        y, _, _ = _ours(mixer, hidden)
        y_pre, conv, ssm = _ours(mixer, hidden[:, :20])
        assert rel(y, y_hf) <= 1e-5 and rel(y_pre, y_pre_hf) <= 1e-5
        assert conv.shape == conv_hf.shape and rel(conv, conv_hf) <= 1e-6
        assert rel(ssm, ssm_hf) <= 1e-5
        y_dec, conv, ssm = _ours(mixer, hidden[:, 20:], conv_state=conv, ssm_state=ssm)
        assert rel(y_dec, y_dec_hf) <= 1e-5
        assert rel(conv, cache.layers[0].conv_states[0]) <= 1e-6
        assert rel(ssm, cache.layers[0].recurrent_states[0]) <= 1e-5
