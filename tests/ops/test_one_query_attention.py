"""Paged attention's one-query (decode) path: grouped heads as rows of one matmul equal SDPA with
enable_gqa, on strided K/V views as the pool gives them."""

import pytest
import torch
import torch.nn.functional as F

from kvstate.ops.attention import _one_query


@pytest.mark.parametrize("heads, kv_heads, length", [(8, 2, 29), (4, 4, 1), (6, 3, 130)])
def test_one_query_equals_sdpa_with_gqa(heads, kv_heads, length):
    g = torch.Generator().manual_seed(heads + length)
    q = torch.randn(heads, 1, 64, generator=g)
    k = torch.randn(length + 3, kv_heads, 64, generator=g)[:length].transpose(0, 1)  # [Hkv, L, D], strided
    v = torch.randn(length + 3, kv_heads, 48, generator=g)[:length].transpose(0, 1)
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)
    out = _one_query(q, k, v, 0.125)
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, atol=1e-6, rtol=1e-5)
