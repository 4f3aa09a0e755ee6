"""The "q8" mode of GGML block weights (llama.cpp's arithmetic, `kernels.ggml_q8`, csrc/quant_q8*): x
quantized to ggml's block_q8_0 / block_q8_K bytes (gguf's Q8_0 quantizer, ggml's quantize_row_q8_K_ref
through ctypes where a llama.cpp build is at hand), each block type's integer dot products on each ISA
path the CPU has against the plain int64 reference (1e-5 relative) and against ggml's own
ggml_vec_dot_*_q8_* on the same bytes, and the mode switch (which calls run which kernel)."""

from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest
import torch

from kvstate.errors import KvstateError
from kvstate.kernels import activation
from kvstate.kernels.blocks import MAX_ROWS
from kvstate.kernels.ggml_blocks import TYPES, dequantize
from kvstate.kernels.ggml_q8 import X_TYPE, linear_q8, x_bytes
from tests.kernels.conftest import extension
from tests.kernels.test_blocks import GGML_BASE, random_blocks

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

GGML_CPU = GGML_BASE.with_name("libggml-cpu.so")
SIGNATURE = {"Q4_0": "q4_0_q8_0", "Q8_0": "q8_0_q8_0", "Q4_K": "q4_K_q8_K", "Q5_K": "q5_K_q8_K", "Q6_K": "q6_K_q8_K"}


@pytest.fixture
def q8():
    """The extension with the q8 mode on; off again after the test."""
    ext = extension()
    ext.set_q8_activations(True)
    yield ext
    ext.set_q8_activations(False)


def isas(ext) -> list[str]:
    """The q8 kernels this CPU runs: "avx512" (VNNI) where it has it, and always "avx2"."""
    return (["avx512"] if ext.quant_q8_has_vnni() else []) + ["avx2"]


def awkward_x(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows of very different size, an all-zero row, one large outlier, a zero Q8_K block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]
    if m > 2:
        x[1] = 0
        x[2, 7] = 3e4
    x[0, 256:512] = 0  # (where k > 256) a zero Q8_K block
    return x


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_x_quantizers_write_ggml_bytes(qtype):
    ext = extension()
    x = awkward_x(6, 512, seed=1)
    x[3, 32:64] = torch.tensor([0.5, -0.5, 2.5, -3.5, 127, 1, 2, 3] * 4)  # d = 1: codes halfway (roundf: 1, -1, 3;
    # Q8_K's ties to even with d = -1: 0, 0, -2)
    want = x_bytes(x.numpy(), qtype)
    if qtype == "Q8_0":  # gguf's quantizer (ggml's quantize_row_q8_0_ref, bit for bit)
        assert np.array_equal(want, quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0))
    elif GGML_BASE.is_file():
        lib = ctypes.CDLL(str(GGML_BASE))
        ref = np.zeros_like(want)
        xs = np.ascontiguousarray(x.numpy())
        for r in range(x.shape[0]):
            lib.quantize_row_q8_K_ref(xs[r].ctypes.data_as(ctypes.c_void_p), ref[r].ctypes.data_as(ctypes.c_void_p),
                                      ctypes.c_int64(512))
        assert np.array_equal(want, ref)
    for isa in isas(ext):
        got = ext.quant_quantize_x(x, TYPES[qtype].type_id, isa).numpy()
        assert np.array_equal(got, want), isa


def test_q8_k_scale_takes_the_sign_of_the_first_largest():
    """ggml's sign trick: d = max / -127 with max the first x of the largest |x|, its code -127."""
    x = np.zeros((1, 256), np.float32)
    x[0, 3], x[0, 9], x[0, 20] = -2.0, 2.0, 1.0
    raw = x_bytes(x, "Q4_K")[0]
    d, qs = raw[:4].view(np.float32)[0], raw[4:260].view(np.int8)
    assert d == np.float32(1) / (np.float32(-127) / np.float32(-2.0)) and qs[3] == -127 and qs[9] == 127
    assert raw[260:].view(np.int16)[0] == 0 and raw[260:].view(np.int16)[1] == 64  # -127 + 127, round(63.5)


@pytest.mark.parametrize("qtype", sorted(X_TYPE))
@pytest.mark.parametrize("n,blocks", [(1, 1), (13, 2), (37, 5)])
def test_kernels_equal_the_integer_reference_on_each_isa(q8, qtype, n, blocks):
    """1 to 9 x rows (the 8-, 4-, 2- and 1-row groups), with and without bias, one block to several;
    random bytes for the weights (K-quants with finite fp16 scales)."""
    t = TYPES[qtype]
    k = blocks * t.block
    raw = torch.from_numpy(random_blocks(qtype, n, blocks, seed=n * 31 + blocks))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    for m in range(1, 10):
        x = awkward_x(m, k, seed=m)
        ref = linear_q8(x.numpy(), raw, qtype) + (bias.double().numpy() if m % 2 else 0)
        for isa in isas(q8):
            before = q8.quant_q8_calls()
            y = q8.quant_linear(x, raw, bias if m % 2 else None, t.type_id, isa)
            after = q8.quant_q8_calls()
            assert after[isa != "avx512"] == before[isa != "avx512"] + 1 and sum(after) == sum(before) + 1
            err = np.linalg.norm(y.double().numpy() - ref) / np.linalg.norm(ref)
            assert err <= 1e-5, (qtype, m, isa, err)


@pytest.mark.parametrize("qtype", sorted(X_TYPE))
def test_kernels_follow_ggmls_own_dot_products(q8, qtype):
    """ggml's ggml_vec_dot_*_q8_* (libggml-cpu) on the weights' and x's bytes: the same sums but for
    the order of the fp32 additions."""
    if not GGML_CPU.is_file():
        pytest.skip(f"no llama.cpp build at {GGML_CPU} (set KVSTATE_GGML_BASE)")
    lib = ctypes.CDLL(str(GGML_CPU))
    lib.ggml_cpu_init()  # its fp16 table
    dot = getattr(lib, f"ggml_vec_dot_{SIGNATURE[qtype]}")
    t = TYPES[qtype]
    k = 4 * 256
    raw = random_blocks(qtype, 11, k // t.block, seed=5)
    x = awkward_x(3, k, seed=2)
    xq = np.ascontiguousarray(x_bytes(x.numpy(), qtype))
    ref = np.zeros((3, 11), np.float32)
    out = ctypes.c_float()
    for m in range(3):
        for n in range(11):
            dot(ctypes.c_int(k), ctypes.byref(out), ctypes.c_size_t(0), raw[n].ctypes.data_as(ctypes.c_void_p),
                ctypes.c_size_t(0), xq[m].ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(0), ctypes.c_int(1))
            ref[m, n] = out.value
    for isa in isas(q8):
        y = q8.quant_linear(x, torch.from_numpy(raw), None, t.type_id, isa).numpy()
        scale = np.abs(ref).max(axis=1, keepdims=True)
        assert np.abs(y - ref).max() <= 1e-5 * scale.max(), isa


@pytest.mark.parametrize("qtype", sorted(X_TYPE))
def test_q8_is_close_to_exact_math(q8, qtype):
    """8-bit x moves each output by about 1% of the exact one (not 0: the q8 path ran)."""
    t = TYPES[qtype]
    raw = torch.from_numpy(random_blocks(qtype, 64, 1024 // t.block, seed=7))
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(4))
    exact = (x.double() @ dequantize(raw, qtype).double().T).numpy()
    y = q8.quant_linear(x, raw, None, t.type_id, "avx2").double().numpy()
    rel = np.linalg.norm(y - exact) / np.linalg.norm(exact)
    assert 1e-4 < rel < 0.05, rel


def test_more_rows_and_other_weights_keep_exact_math(q8):
    """Past MAX_ROWS rows (prefill) the exact kernel runs; bf16 weights are not the q8 mode's."""
    raw = torch.from_numpy(random_blocks("Q4_K", 8, 2, seed=3))
    x = torch.randn(MAX_ROWS + 1, 512, generator=torch.Generator().manual_seed(5))
    before, exact_before = q8.quant_q8_calls(), q8.quant_calls()
    y = q8.quant_linear(x, raw, None, 12, "avx2")
    assert q8.quant_q8_calls() == before and sum(q8.quant_calls()) == sum(exact_before) + 1
    ref = x.double() @ dequantize(raw, "Q4_K").double().T
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6
    w = torch.randn(16, 512, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    q8.set_q8_activations(False)
    off = q8.linear(x[:3], w)
    q8.set_q8_activations(True)
    assert torch.equal(q8.linear(x[:3], w), off)


def test_the_mode_switch():
    ext = extension()
    try:
        activation.set_activation_dtype("q8")
        assert ext.q8_activations() and activation.activation_dtype() == "q8" and ext.activation_parts() == 0
        activation.set_activation_dtype("fp32")
        assert not ext.q8_activations() and activation.activation_dtype() == "fp32"
    finally:
        activation.set_activation_dtype("fp32")


def test_without_the_kernels_q8_is_one_line(monkeypatch):
    monkeypatch.setattr(activation, "q8_available", lambda: False)
    with pytest.raises(KvstateError, match="activation dtype q8: needs the compiled kernels on a CPU with AVX2"):
        activation.set_activation_dtype("q8")


def test_x_types_are_ggmls_vec_dot_types():
    assert X_TYPE == {"Q8_0": "Q8_0", "Q4_0": "Q8_0", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K"}
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K] == (256, 292)


def test_the_benchmark_runs(capsys):
    from kvstate.bench.quant_q8 import main

    extension()
    argv = ["--types", "q4_k", "--rows", "1,2", "--mib", "1", "--rounds", "1", "--min-time", "0.01", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["type"], r["rows"]) for r in out["results"]] == [("Q4_K", 1), ("Q4_K", 2)] * 2
    assert all(r["q8_gbs"] > 0 and r["exact_gbs"] > 0 for r in out["results"])
    assert main(["--types", "q3_k"]) == 2
    assert main(["--types", "iq4_xs"]) == 2  # a kept block type the q8 mode does not serve: one line, no traceback
    assert main(["--rows", "x"]) == 2 and main(["--rows", "65"]) == 2  # not a number; past the q8 mode's rows


def test_mixed_parts_of_one_input_run_q8_each_as_alone(q8):
    """quant_linear_parts (a Q4_K_M layer's q/k/v: Q4_K beside Q6_K; here Q8_0 too): each part's columns
    are what the reference gives it, from x quantized once per x type; one q8 call, no exact one."""
    parts = [("Q4_K", 40), ("Q6_K", 24), ("Q8_0", 9), ("Q4_K", 3)]
    raws = [torch.from_numpy(random_blocks(q, n, 1024 // TYPES[q].block, seed=i)) for i, (q, n) in enumerate(parts)]
    types = [TYPES[q].type_id for q, _ in parts]
    for m in (1, 5):
        x = awkward_x(m, 1024, seed=m)
        for isa in isas(q8):
            before, exact = q8.quant_q8_calls(), sum(q8.quant_calls())
            y = q8.quant_linear_parts(x, raws, types, isa).double().numpy()
            assert sum(q8.quant_q8_calls()) == sum(before) + 1 and sum(q8.quant_calls()) == exact
            ref = np.concatenate([linear_q8(x.numpy(), raw, q) for raw, (q, _) in zip(raws, parts)], axis=1)
            assert np.linalg.norm(y - ref) / np.linalg.norm(ref) <= 1e-5, (m, isa)


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS"])
def test_types_q8_does_not_serve_keep_exact_math(q8, qtype):
    """The IQ4 blocks have no integer kernels here: in q8 mode they run the exact ones, alone and in parts."""
    if qtype not in TYPES:
        pytest.skip(f"{qtype} blocks are not served")
    t = TYPES[qtype]
    raw = torch.from_numpy(random_blocks(qtype, 8, 512 // t.block, seed=1))
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(2))
    before, exact = q8.quant_q8_calls(), sum(q8.quant_calls())
    y = q8.quant_linear(x, raw, None, t.type_id, "avx2")
    q4 = torch.from_numpy(random_blocks("Q4_K", 4, 2, seed=3))
    q8.quant_linear_parts(x, [raw, q4], [t.type_id, TYPES["Q4_K"].type_id], "avx2")
    assert q8.quant_q8_calls() == before and sum(q8.quant_calls()) == exact + 2
    ref = x.double() @ dequantize(raw, qtype).double().T
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6
