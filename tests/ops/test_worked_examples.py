"""The worked numbers of /work/shared/spec/000_7606d1ca104004e6.txt, through every form of the ops.

2-D toy: keys k1 = [1, 0], k2 = [0, 1], k3 = [0.6, 0.8]; values v1 = [5, 1], v2 = [2, 4], v3 = [0, 6];
scale = 1. The document writes the state as [V, K] (S = sum v k^T, read S q); ours is its transpose.
Sequence b of the batch queries with key b+1 at every token, so o[b, t] is the read of k_{b+1}
right after token t's write.
"""

import pytest
import torch

from kvstate.ops.delta_rule import chunk_delta_rule, naive_delta_rule, recurrent_delta_rule
from kvstate.ops.gated_delta_rule import chunk_gated_delta_rule
from kvstate.ops.gated_linear_attention import chunk_gated_linear_attention
from kvstate.ops.linear_attention import chunk_linear_attention, naive_linear_attention, recurrent_linear_attention

KEYS = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], dtype=torch.float64)
VALUES = torch.tensor([[5.0, 1.0], [2.0, 4.0], [0.0, 6.0]], dtype=torch.float64)


def toy():
    """q [3, 3, 1, 2] (sequence b queries with key b+1), k [3, 3, 1, 2], v [3, 3, 1, 2], beta = 1."""
    q = KEYS[:, None, None, :].expand(3, 3, 1, 2).contiguous()
    k = KEYS[None, :, None, :].expand(3, 3, 1, 2).contiguous()
    v = VALUES[None, :, None, :].expand(3, 3, 1, 2).contiguous()
    return q, k, v, torch.ones(3, 3, 1, dtype=torch.float64)


LINEAR = [naive_linear_attention, recurrent_linear_attention,
          lambda *a, **kw: chunk_linear_attention(*a, chunk_size=2, **kw),
          lambda q, k, v, **kw: chunk_gated_linear_attention(q, k, v, torch.zeros(3, 3, 1, dtype=q.dtype), **kw)]
DELTA = [naive_delta_rule, recurrent_delta_rule, lambda *a, **kw: chunk_delta_rule(*a, chunk_size=2, **kw),
         lambda q, k, v, beta, **kw: chunk_gated_delta_rule(q, k, v, torch.zeros_like(beta), beta, **kw)]


@pytest.mark.parametrize("fn", LINEAR)
def test_linear_attention_capacity(fn):
    q, k, v, _ = toy()
    o, s = fn(q, k, v, scale=1.0, output_final_state=True)
    # after two writes: S = [[5, 2], [1, 4]] and both orthogonal keys read back exactly
    torch.testing.assert_close(o[0, 1, 0], VALUES[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(o[1, 1, 0], VALUES[1], rtol=0, atol=1e-12)
    # after the third write: S = [[5, 2], [4.6, 8.8]] and every read is wrong
    torch.testing.assert_close(s[0, 0].T, torch.tensor([[5.0, 2.0], [4.6, 8.8]], dtype=torch.float64),
                               rtol=0, atol=1e-12)
    wrong = torch.tensor([[5.0, 4.6], [2.0, 8.8], [4.6, 9.8]], dtype=torch.float64)  # reads of k1, k2, k3
    torch.testing.assert_close(o[:, 2, 0], wrong, rtol=0, atol=1e-12)
    assert (o[:, 2, 0] - VALUES).abs().amax(dim=1).min() > 3.0  # no read is even close


@pytest.mark.parametrize("fn", DELTA)
def test_delta_rule_overwrites(fn):
    q, k, v, beta = toy()
    o, s = fn(q, k, v, beta, scale=1.0, output_final_state=True)
    torch.testing.assert_close(o[0, 1, 0], VALUES[0], rtol=0, atol=1e-12)  # orthogonal keys: still exact
    torch.testing.assert_close(o[1, 1, 0], VALUES[1], rtol=0, atol=1e-12)
    reads = torch.tensor([[2.24, 2.32], [-1.68, 5.76], [0.0, 6.0]], dtype=torch.float64)  # k1, k2, k3
    torch.testing.assert_close(o[:, 2, 0], reads, rtol=0, atol=1e-12)  # the newest pair reads back exactly
    torch.testing.assert_close(s[0, 0].T, torch.tensor([[2.24, -1.68], [2.32, 5.76]], dtype=torch.float64),
                               rtol=0, atol=1e-12)
