"""Block.forward_pending: a block's last residual add left to the next block's first norm (the
decoder's loop) gives the same hidden states as adding it at once, for every block shape."""

import pytest
import torch
from torch import nn

from kvstate.layers.norm import RMSNorm
from kvstate.models.decoder import Block


class Mixer(nn.Module):
    """A stand-in token mixer: mixer(x [T, H], batch, cache) -> [T, H]."""

    def __init__(self, h: int):
        super().__init__()
        self.proj = nn.Linear(h, h)

    def forward(self, x, batch, cache):
        return torch.tanh(self.proj(x))


def blocks(h: int, norm):
    return {"mixer+ffn": Block(Mixer(h), nn.Linear(h, h), norm), "mixer": Block(Mixer(h), None, norm),
            "ffn": Block(None, nn.Linear(h, h), norm)}


@pytest.mark.parametrize("norm", ["rms", "layernorm"])  # with and without a fused add_forward
def test_pending_adds_equal_the_plain_blocks(norm):
    torch.manual_seed(0)
    h = 24
    make = (lambda: RMSNorm(h, 1e-6)) if norm == "rms" else (lambda: nn.LayerNorm(h))
    stack = [*blocks(h, make).values(), *blocks(h, make).values()]
    for b in stack:
        for p in b.parameters():
            p.data.normal_()
    x = torch.randn(5, h)
    with torch.inference_mode():
        ref = x
        for b in stack:
            ref = b(ref, None, None)
        y, delta = x, None
        for b in stack:
            y, delta = b.forward_pending(y, delta, None, None)
            assert delta is not None
        torch.testing.assert_close(y + delta, ref, rtol=1e-6, atol=1e-6)
        empty = Block(None, None, make)  # neither part: the pending add passes through
        assert empty.forward_pending(y, delta, None, None) == (y, delta)
