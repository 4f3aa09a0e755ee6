"""kvstate: run, measure and understand hybrid LLMs.

Hybrid models keep a growing KV cache in a few full-attention layers and a fixed-size recurrent
state in the rest (Gated DeltaNet, KDA, Mamba-2, Mamba-1). The package is layered so that the
control plane (config reading, memory planning, scheduling) never imports torch; heavy parts
are imported on first use:

    from kvstate import LLM, SamplingParams
"""

__version__ = "0.1.0"

from kvstate.errors import KvstateError

__all__ = ["LLM", "KvstateError", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from kvstate.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvstate.engine.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvstate' has no attribute {name!r}")
