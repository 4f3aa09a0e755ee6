"""States at positions inside a chunk (kvstate.ops.states_at): for Gated DeltaNet, KDA, Mamba-2 (SSD)
and Mamba-1 (selective scan), packed varlen sequences with positions at chunk boundaries, between
them, at 1 and at length - 1, the naive and chunk forms return the same outputs and final state
as one whole call of the chunk form, and every returned state equals the recurrent form's state
after that token (its output_all_states); the conv windows equal the window after those tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstate.ops import causal_conv1d
from kvstate.ops.gated_delta_rule import chunk_gated_delta_rule, naive_gated_delta_rule, recurrent_gated_delta_rule
from kvstate.ops.kda import chunk_kda, naive_kda, recurrent_kda
from kvstate.ops.selective_scan import chunk_selective_scan, naive_selective_scan, recurrent_selective_scan
from kvstate.ops.ssd import chunk_ssd, naive_ssd, recurrent_ssd
from kvstate.ops.states_at import conv_windows_at, states_at

LENS = [50, 7, 77]
POSITIONS = [[1, 32, 33, 49], [], [5, 64, 70]]  # chunk size 32 (GDN) and 64 (the others): boundaries and between


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def case(name):
    """(forms (naive, chunk, recurrent), per-token inputs [1, T, ...], other kwargs, initial state [N, ...])."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    t, n = sum(LENS), len(LENS)
    if name == "gated_deltanet":
        tokens = dict(q=r(1, t, 2, 16), k=r(1, t, 2, 16), v=r(1, t, 4, 8), g=F.logsigmoid(r(1, t, 4) + 3.0),
                      beta=torch.sigmoid(r(1, t, 4)))
        forms = (naive_gated_delta_rule, chunk_gated_delta_rule, recurrent_gated_delta_rule)
        return forms, tokens, dict(use_qk_l2norm_in_kernel=True), 0.5 * r(n, 4, 16, 8)
    if name == "kda":
        tokens = dict(q=r(1, t, 2, 16), k=r(1, t, 2, 16), v=r(1, t, 2, 8), g=F.logsigmoid(r(1, t, 2, 16)),
                      beta=torch.rand(1, t, 2, generator=g))
        return (naive_kda, chunk_kda, recurrent_kda), tokens, dict(use_qk_l2norm_in_kernel=True), 0.5 * r(n, 2, 16, 8)
    if name == "ssd":
        tokens = dict(x=r(1, t, 4, 8), dt=r(1, t, 4) - 1.0, B=r(1, t, 2, 16), C=r(1, t, 2, 16))
        kw = dict(A=-torch.exp(r(4)), D=r(4), dt_bias=0.5 * r(4), dt_softplus=True)
        return (naive_ssd, chunk_ssd, recurrent_ssd), tokens, kw, 0.5 * r(n, 4, 16, 8)
    tokens = dict(u=r(1, t, 12), delta=r(1, t, 12), B=r(1, t, 6), C=r(1, t, 6), z=r(1, t, 12))
    kw = dict(A=-torch.exp(0.5 * r(12, 6)), D=r(12), delta_bias=r(12) - 1, delta_softplus=True)
    return (naive_selective_scan, chunk_selective_scan, recurrent_selective_scan), tokens, kw, 0.5 * r(n, 12, 6)


@pytest.mark.parametrize("name", ["gated_deltanet", "kda", "ssd", "selective_scan"])
def test_naive_chunk_and_recurrent_agree_on_every_state(name):
    (naive, chunk, recurrent), tokens, kw, s0 = case(name)
    cu = [0, LENS[0], LENS[0] + LENS[1], sum(LENS)]
    cu_t = torch.tensor(cu)
    o_ref, final_ref = chunk(**tokens, **kw, initial_state=s0, output_final_state=True, cu_seqlens=cu_t)
    _, _, every = recurrent(**tokens, **kw, initial_state=s0, output_final_state=True, cu_seqlens=cu_t,
                            output_all_states=True)  # [1, T, *state]: the state after every token
    for form in (naive, chunk):
        o, final, states = states_at(form, tokens, positions=POSITIONS, initial_state=s0, cu_seqlens=cu, **kw)
        assert rel(o, o_ref) <= 1e-4 and rel(final, final_ref) <= 1e-4, form.__name__
        assert [len(s) for s in states] == [len(p) for p in POSITIONS]
        for i, ps in enumerate(POSITIONS):
            for p, state in zip(ps, states[i]):
                assert rel(state, every[0, cu[i] + p - 1]) <= 1e-4, (form.__name__, i, p)


def test_no_positions_is_one_call_of_the_form():
    (_, chunk, _), tokens, kw, s0 = case("gated_deltanet")
    cu = [0, LENS[0], LENS[0] + LENS[1], sum(LENS)]
    o, final, states = states_at(chunk, tokens, positions=[[], [], []], initial_state=s0, cu_seqlens=cu, **kw)
    o_ref, final_ref = chunk(**tokens, **kw, initial_state=s0, output_final_state=True, cu_seqlens=torch.tensor(cu))
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref) and states == [[], [], []]


@pytest.mark.parametrize("width", [4, 3])  # a window of kernel columns, or kernel - 1
def test_conv_windows_at_equal_the_window_after_those_tokens(width):
    g = torch.Generator().manual_seed(1)
    window, x, w = torch.randn(6, width, generator=g), torch.randn(20, 6, generator=g), torch.randn(6, 4, generator=g)
    for p in (1, 2, 3, 7, 19):
        _, after = causal_conv1d(x[None, :p], w, None, initial_state=window[None], output_final_state=True)
        assert torch.allclose(conv_windows_at(window, x, [p])[0], after[0, :, -width:])


@pytest.mark.parametrize("split", [False, True], ids=["one-thread", "head-split"])
@pytest.mark.parametrize("name,decay", [("gated_deltanet", True), ("gated_deltanet", False), ("ssd", True),
                                        ("kda", True)])
def test_chunk_forms_return_states_from_their_own_scan(name, decay, split, monkeypatch):
    """chunk_gated_delta_rule, chunk_kda and chunk_ssd (over chunk_gated_linear_attention) with state_positions:
    at chunk boundaries (32, 64) the carried state, inside a chunk a partial step; equal to the
    recurrent form's state after those tokens, with the output and final state of the call without
    positions (also when key heads are split over workers)."""
    from kvstate.ops import _threads

    if split:
        monkeypatch.setattr(_threads, "MIN_WORK", 0)
    (_, chunk, recurrent), tokens, kw, s0 = case(name)
    if not decay:
        tokens["g"] = torch.zeros_like(tokens["g"])
    cu = torch.tensor([0, LENS[0], LENS[0] + LENS[1], sum(LENS)])
    o_ref, final_ref = chunk(**tokens, **kw, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    _, _, every = recurrent(**tokens, **kw, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                            output_all_states=True)
    o, final, states = chunk(**tokens, **kw, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                             state_positions=POSITIONS)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)
    for i, ps in enumerate(POSITIONS):
        assert len(states[i]) == len(ps)
        for p, state in zip(ps, states[i]):
            assert rel(state, every[0, int(cu[i]) + p - 1]) <= 1e-4, (i, p)
    with pytest.raises(ValueError, match="state_positions"):
        chunk(**tokens, **kw, initial_state=s0, cu_seqlens=cu, state_positions=[[50], [], []])
