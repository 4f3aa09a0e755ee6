"""The thin-input linear: split over worker threads it equals F.linear, and it keeps autograd."""

import torch
import torch.nn.functional as F

from kvstate.layers import linear as lin
from kvstate.ops import _threads


def test_split_equals_f_linear(monkeypatch):
    monkeypatch.setattr(lin, "MIN_WEIGHT", 0)
    monkeypatch.setattr(_threads, "MAX_WORKERS", 3)
    calls, run = [], _threads.run
    monkeypatch.setattr(_threads, "run", lambda tasks: calls.append(len(tasks)) or run(tasks))
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(301, 64, generator=g), torch.randn(301, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            for rows in (1, 5, 64):
                x = torch.randn(rows, 64, generator=g)
                torch.testing.assert_close(lin.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(lin.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
            big = torch.randn(65, 64, generator=g)  # prefill-sized: torch's own GEMM
            assert torch.equal(lin.linear(big, w, b), F.linear(big, w, b))
        assert calls == [2] * 6  # thin calls split over the 2 threads torch was given
    finally:
        torch.set_num_threads(threads)


def test_module_keeps_state_dict_and_autograd():
    layer = lin.Linear(8, 4)
    assert set(layer.state_dict()) == {"weight", "bias"}
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
