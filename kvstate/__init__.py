"""kvstate: run, measure and understand hybrid LLMs.

Hybrid models keep a growing KV cache in a few full-attention layers and a fixed-size recurrent
state in the rest (Gated DeltaNet, KDA, Mamba-2, Mamba-1). The package is layered so that the
control plane (config reading, memory planning, scheduling) never imports torch; heavy parts
are imported on first use.
"""

__version__ = "0.1.0"

from kvstate.errors import KvstateError

__all__ = ["KvstateError", "__version__"]
