"""(I + A)^-1 for a batch of strictly lower-triangular A [..., C, C], in matmuls.

The chunked delta rule needs T = (I + A)^-1 per chunk (the WY representation). One LAPACK
triangular solve per 64 x 64 chunk runs at ~25 GFLOP/s on CPU; here the 16 x 16 diagonal blocks
are inverted by triangular solves (forward substitution: stable, unlike a Neumann series,
whose powers of A can be far larger than the inverse when keys repeat), then merged two by two:

    [[L11, 0], [L21, L22]]^-1 = [[T11, 0], [-T22 L21 T11, T22]]

so T costs a few small batched matmuls, and T @ rhs is one efficient batched matmul.
fla's `solve_tril` merges the same way.
"""

from __future__ import annotations

import torch

BLOCK = 16


def unit_lower_inverse(A: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """A strictly lower-triangular [..., C, C] (C a multiple of `block`, the block count a power of 2)
    -> (I + A)^-1 [..., C, C]. Only A's strictly lower part is read."""
    c = A.shape[-1]
    n = c // block
    if n * block != c or n & (n - 1):
        raise ValueError(f"A's size ({c}) must be a power-of-two multiple of {block}")
    diag = A.unflatten(-2, (n, block)).unflatten(-1, (n, block)).diagonal(dim1=-4, dim2=-2)
    diag = diag.movedim(-1, -3)  # [..., n, block, block]: the diagonal blocks
    eye = torch.eye(block, dtype=A.dtype, device=A.device).expand(diag.shape)
    T = torch.linalg.solve_triangular(diag, eye, upper=False, unitriangular=True)  # [..., n, b, b]
    size = block
    while T.shape[-3] > 1:
        m = T.shape[-3] // 2
        T11, T22 = T[..., 0::2, :, :], T[..., 1::2, :, :]  # [..., m, size, size]
        # L21 of each pair: rows of its second half, columns of its first half
        pairs = A.unflatten(-2, (m, 2 * size)).unflatten(-1, (m, 2 * size)).diagonal(dim1=-4, dim2=-2)
        L21 = pairs.movedim(-1, -3)[..., size:, :size]  # [..., m, size, size]
        T21 = -torch.matmul(T22, torch.matmul(L21, T11))
        T = torch.cat([torch.cat([T11, torch.zeros_like(T11)], dim=-1), torch.cat([T21, T22], dim=-1)], dim=-2)
        size *= 2
    return T.squeeze(-3)
