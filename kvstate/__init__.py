"""kvstate: run, measure and understand hybrid LLMs.

Hybrid models keep a growing KV cache in a few full-attention layers and a fixed-size recurrent
state in the rest (Gated DeltaNet, KDA, Mamba-2, Mamba-1). The package is layered so that the
control plane (config reading, memory planning, scheduling) never imports torch; heavy parts
are imported on first use:

    from kvstate import LLM, SamplingParams          # the offline API
    from kvstate import EngineCore                   # step by step: what a server's loop drives
    kvstate.model_path("kvstate-phonebook-hybrid")   # a shipped trained model's directory
"""

__version__ = "0.1.0"

from kvstate.errors import KvstateError, UnknownTokenWarning
from kvstate.shipped import model_path

__all__ = ["LLM", "CompletionOutput", "EngineCore", "KvstateError", "RequestOutput", "SamplingParams",
           "UnknownTokenWarning", "__version__", "model_path"]

# name -> module, imported on first use (LLM and EngineCore load torch when built)
_LAZY = {"LLM": "kvstate.llm", "EngineCore": "kvstate.engine.core", "SamplingParams": "kvstate.engine.params",
         "RequestOutput": "kvstate.engine.outputs", "CompletionOutput": "kvstate.engine.outputs"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvstate' has no attribute {name!r}")
