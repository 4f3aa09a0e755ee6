"""`kvstate.kernels.linear`: any leading shape, the fallback forced (context manager and
environment) and checked the same way, what goes to torch, `info()`, and the Linear drop-in."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from kvstate import kernels
from kvstate.kernels import activation, _ext, dispatch
from tests.kernels.conftest import assert_close_to_truth, extension

BACKENDS = ["auto", "torch", "amx", "avx512", "avx2"]


def available(name):
    if name in ("amx", "avx512", "avx2") and name not in extension().isas():
        pytest.skip(f"this CPU has no {name}")
    if name == "auto":
        extension()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_against_truth(name, dtype):
    if name != "torch":
        available(name)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(45, 77, generator=g).to(dtype)  # 32 rows for AMX, 13 for the rest
    b = torch.randn(45, generator=g)
    with kernels.backend(name):
        for shape in [(77,), (1, 77), (2, 3, 77), (17, 77), (40, 77), (70, 77), (0, 77)]:  # 40: AMX in 2 chunks
            x = torch.randn(*shape, generator=g)
            y = kernels.linear(x, w, b)
            assert y.shape == (*shape[:-1], 45)
            assert_close_to_truth(y.reshape(-1, 45), x.reshape(-1, 77), w, b)


def test_environment_forces_the_fallback(monkeypatch):
    ext = extension()
    calls = []
    monkeypatch.setattr(_ext, "_loaded", {"module": _Spy(ext, calls), "reason": None})
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    kernels.linear(x, w)
    assert calls == ["auto"]
    monkeypatch.setenv(kernels.ENV, "Torch ")
    monkeypatch.setattr(dispatch, "_DEFAULT", dispatch.backend_from_env())  # what an import reads
    torch.testing.assert_close(kernels.linear(x, w), x @ w.T)
    assert calls == ["auto"] and kernels.info()["backend"] == "torch"
    with kernels.backend("avx2"):  # the context manager wins over the environment
        kernels.linear(x, w)
    assert calls == ["auto", "avx2"]
    monkeypatch.setattr(dispatch, "_DEFAULT", "fast")
    with pytest.raises(ValueError, match="KVSTATE_KERNELS='fast'"):
        kernels.linear(x, w)


def test_environment_is_read_at_import():
    env = dict(os.environ, KVSTATE_KERNELS="torch")
    code = "from kvstate import kernels; print(kernels.info()['backend'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "torch"


def test_what_goes_to_torch(monkeypatch):
    """More than MAX_ROWS rows (MAX_ROWS_BF16 for bf16 weights, in one call), autograd, a float64 x, a
    non-contiguous weight: F.linear, still right."""
    ext = extension()
    calls = []
    monkeypatch.setattr(_ext, "_loaded", {"module": _Spy(ext, calls), "reason": None})
    w = torch.randn(8, 16, dtype=torch.float32)
    kernels.linear(torch.randn(kernels.MAX_ROWS, 16), w)
    assert len(calls) == 1
    x = torch.randn(kernels.MAX_ROWS + 1, 16)
    torch.testing.assert_close(kernels.linear(x, w), x @ w.T)
    assert len(calls) == 1
    xb = torch.randn(kernels.MAX_ROWS_BF16, 16)
    torch.testing.assert_close(kernels.linear(xb, w.bfloat16()), xb @ w.bfloat16().float().T)
    assert len(calls) == 2
    calls.clear()
    xbb = torch.cat([xb, xb])
    torch.testing.assert_close(kernels.linear(xbb, w.bfloat16()), xbb @ w.bfloat16().float().T)
    # where the CPU has AVX512_BF16 (and no AMX) the extension's GEMM serves these rows too
    assert len(calls) == (1 if activation.gemm_serves("auto") else 0)
    calls.clear()
    wg = w.clone().requires_grad_()
    kernels.linear(torch.randn(2, 16), wg).sum().backward()
    assert wg.grad is not None
    xd = torch.randn(2, 16, dtype=torch.float64)
    torch.testing.assert_close(kernels.linear(xd, w.bfloat16()), xd @ w.bfloat16().double().T)
    wt = torch.randn(16, 8).T
    torch.testing.assert_close(kernels.linear(x[:2], wt), x[:2] @ wt.T)
    assert calls == []


def test_info_says_which_path():
    extension()
    info = kernels.info()
    assert info["backend"] == "extension" and info["isa"] == info["isas"][0] and info["reason"] is None
    with kernels.backend("torch"):
        assert kernels.info()["backend"] == "torch"
    with pytest.raises(ValueError):
        kernels.backend("cuda").__enter__()


def test_a_missing_build_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(_ext, "_loaded", {})
    monkeypatch.setenv(_ext.CACHE_ENV, str(tmp_path))  # an empty cache, and no build on first use
    monkeypatch.setenv(_ext.BUILD_ENV, "0")
    assert _ext.load() is None and "not built" in _ext.unavailable_reason()
    assert kernels.info()["backend"] == "torch"
    x, w = torch.randn(2, 5), torch.randn(3, 5).bfloat16()
    torch.testing.assert_close(kernels.linear(x, w), x @ w.float().T)


def test_linear_module_keeps_bf16_weights():
    torch.manual_seed(0)
    ref = nn.Linear(40, 24)
    lin = kernels.Linear.from_linear(ref, weight_dtype=torch.bfloat16)
    assert lin.weight.dtype == torch.bfloat16 and lin.bias is ref.bias
    assert set(lin.state_dict()) == {"weight", "bias"}
    x = torch.randn(3, 40)
    with torch.no_grad():
        assert_close_to_truth(lin(x), x, lin.weight, lin.bias)
        fresh = kernels.Linear(40, 24, weight_dtype=torch.bfloat16)
        fresh.load_state_dict(lin.state_dict())
        assert torch.equal(fresh(x), lin(x)) and "weight_dtype=torch.bfloat16" in repr(fresh)
        same = kernels.Linear.from_linear(ref)
        assert same.weight is ref.weight and torch.allclose(same(x), ref(x), atol=1e-5)


class _Spy:
    """Wraps the extension to record which ISA each call asked for."""

    def __init__(self, ext, calls):
        self.ext, self.calls = ext, calls

    def linear(self, x, w, b, isa, scale=None):
        self.calls.append(isa)
        return self.ext.linear(x, w, b, isa, scale=scale)

    def __getattr__(self, name):  # everything else (isas, has_avx512_bf16, isa_cap...) as the extension
        return getattr(self.ext, name)
