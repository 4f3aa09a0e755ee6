"""What a family adapter is: the module of kvstate/families/ for one set of HF model_types.

A family module is an instance of these protocols (a module type-checks against a Protocol
whose members it defines). Planning (`kvstate memory`) needs `FamilyAdapter`; building and
loading a model needs `RunnableFamily`. Nothing else is asked of a family: a name a family
module defines beyond these is its own (qwen3_5's `mtp_targets` serves its `weight_targets`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvstate.config.fields import ConfigView
from kvstate.config.options import ModelOptions
from kvstate.config.plan import ModelPlan


@runtime_checkable
class FamilyAdapter(Protocol):
    """A family that can be planned."""

    MODEL_TYPES: tuple[str, ...]  # the HF config.json model_types it reads

    def read(self, cfg: ConfigView, name: str) -> ModelPlan:
        """The normalized layer plan of a config (kvstate.config.plan); `name` its display name."""
        ...


@runtime_checkable
class RunnableFamily(FamilyAdapter, Protocol):
    """A family that can also be built and loaded (kvstate.models.loader, kvstate.models.saver)."""

    def model_options(self, cfg: ConfigView) -> ModelOptions:
        """The numerical conventions of its HF implementation (norm eps, rope, activations)."""
        ...

    def weight_targets(self, name: str, plan: ModelPlan) -> list | None:
        """Where an HF checkpoint tensor goes in kvstate's parameters (a list of the families' `Target`s);
        None: not ours (skipped)."""
        ...
