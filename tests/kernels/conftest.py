"""Shared helpers for the kernel tests: the fp64 truth, an error bound, and the built extension."""

import pytest
import torch

from kvstate.kernels import _ext, build


def extension():
    """The compiled extension, or skip the test with a plain message saying why it is missing; where
    the kernels are required (CI, KVSTATE_REQUIRE_KERNELS=1) a missing extension fails the test."""
    module = _ext.load()
    if module is None:
        message = f"kvstate kernels not built: {_ext.unavailable_reason()}"
        if build.required():
            pytest.fail(f"{message} (required here: {build.REQUIRE_ENV}=1 or CI)", pytrace=False)
        pytest.skip(message)
    return module


def assert_close_to_truth(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rel=1e-6):
    """y against x @ w^T + b in fp64 (w as stored, widened exactly), elementwise within `rel` of the
    sum of |terms| (the scale fp32 rounding errors grow with). F.linear in fp32 stays within 2e-7
    of it on these tests; x rounded to bf16 anywhere (or to 16 bits) would not."""
    xd, wd = x.double(), w.double()
    truth = xd @ wd.T + (b.double() if b is not None else 0)
    scale = xd.abs() @ wd.abs().T + (b.double().abs() if b is not None else 0)
    assert y.shape == truth.shape and y.dtype == torch.float32
    err = (y.double() - truth).abs()
    worst = (err / (scale + 1e-30)).max().item() if err.numel() else 0.0
    assert worst <= rel, f"max error {worst:.3g} of the |terms| scale (allowed {rel})"


@pytest.fixture(params=["avx512", "avx2"])
def gdn_isa(request):
    """Run the test with each form of the gated delta rule's per-head decode kernel this CPU has."""
    module = extension()
    before = module.gdn_head_isa()
    try:
        module.set_gdn_head_isa(request.param)
    except ValueError as exc:
        pytest.skip(str(exc))
    assert module.gdn_head_isa() == request.param
    yield request.param
    module.set_gdn_head_isa(before)
