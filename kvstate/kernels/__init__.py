"""CPU kernels for decode: skinny GEMMs y = x @ W^T with W stored in fp32 or bf16, fp32 math.

A decode step reads every weight once for a handful of rows, so its speed is the speed at which
the weights stream from memory. `linear` runs a compiled kernel (AMX, AVX-512 or AVX2, whichever
the CPU has; built at install by `python -m kvstate.kernels.build`) for such inputs and
`F.linear` otherwise; `Linear` is the nn.Linear drop-in whose weight may be kept in bf16;
`info()` says which path is active.
"""

from kvstate.kernels.dispatch import (
    CHOICES,
    ENV,
    MAX_ROWS,
    MAX_ROWS_BF16,
    backend,
    choice,
    info,
    linear,
    torch_linear,
)
from kvstate.kernels.linear_module import Embedding, Linear


def extension():
    """The compiled extension module, or None where it is not built or cannot load (`info()` says why)."""
    from kvstate.kernels import _ext

    return _ext.load()

__all__ = ["CHOICES", "ENV", "MAX_ROWS", "MAX_ROWS_BF16", "Embedding", "Linear", "backend", "choice", "extension",
           "info", "linear", "torch_linear"]
