"""The normalized layer plan: what every model family is translated into (no torch).

`ModelPlan.layers` holds one `LayerSpec` per decoder block. A block has zero, one or more
token mixers (Falcon-H1 runs attention and Mamba-2 side by side; Nemotron-H's MLP/MoE blocks
have none) and one FFN. Each mixer kind (`kvstate.config.mixers`) is a small frozen dataclass
carrying exactly the dims that size its cache and its weights, and giving both; the weight facts
that differ between families (q/k norms, biases, gates) are flags of the kinds and of `FfnSpec`,
so the parameter count needs no per-family correction. The cache spec
(`kvstate.cache.spec`), the memory planner, the model builder and the engine's pools all read
this one description.

Layer letters (`ModelPlan.layer_string`, one per block):
    A full attention (MHA/GQA)     L MLA (latent attention)     G Gated DeltaNet
    K KDA (Kimi Delta Attention)   M Mamba-2                    S Mamba-1 (selective scan)
    C short convolution (LFM2)     - no mixer (MLP/MoE block)   H several mixers in one block
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvstate.config.mixers import (  # noqa: F401  (the mixer kinds are part of the plan's vocabulary)
    KV_KINDS,
    LETTERS,
    MIXER_KINDS,
    AttentionSpec,
    GatedDeltaNetSpec,
    KDASpec,
    Mamba1Spec,
    Mamba2Spec,
    MixerSpec,
    MLASpec,
    ShortConvSpec,
)


NO_MIXER, MULTI_MIXER = "-", "H"


@dataclass(frozen=True, slots=True)
class FfnSpec:
    """The block's feed-forward part: "mlp", "moe" (routed experts + optional shared) or "none"."""

    kind: str  # "mlp" | "moe" | "none"
    intermediate_size: int = 0  # mlp width
    gated: bool = True  # SwiGLU-style gate/up/down (False: up/down only, e.g. Nemotron's relu2)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_intermediate_size: int = 0  # total width of the always-on shared expert(s), 0 if none
    latent_size: int = 0  # routed experts work in this width between two projections (Nemotron), 0: hidden
    shared_expert_gate: bool = False  # the shared expert's output is scaled by sigmoid(hidden -> 1 linear) (Qwen)
    bias: bool = False  # mlp_bias: the dense MLP, shared expert and latent projections (never routed experts)

    def __post_init__(self) -> None:
        if self.kind not in ("mlp", "moe", "none"):
            raise ValueError(f"FfnSpec.kind must be 'mlp', 'moe' or 'none', got {self.kind!r}")

    def params(self, hidden: int) -> tuple[int, int]:
        """(dense MLP weights, MoE weights: routed experts + router + shared expert and its gate)."""
        mats = 3 if self.gated else 2

        def mlp(width: int) -> int:  # gate (if gated), up, down; biases of width, width and hidden
            return mats * hidden * width + ((mats - 1) * width + hidden) * (self.bias and width > 0)

        if self.kind == "mlp":
            return mlp(self.intermediate_size), 0
        if self.kind == "moe":
            width = self.latent_size or hidden  # latent MoE: experts between hidden -> latent -> hidden projections
            experts = self.num_experts * mats * width * self.expert_intermediate_size
            latent = 2 * hidden * self.latent_size + (self.latent_size + hidden) * self.bias if self.latent_size else 0
            router = hidden * self.num_experts
            return 0, experts + latent + router + mlp(self.shared_intermediate_size) + hidden * self.shared_expert_gate
        return 0, 0


FFN_NONE = FfnSpec("none")


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One decoder block: its index, its token mixers (0, 1 or more) and its FFN."""

    index: int
    mixers: tuple[MixerSpec, ...]
    ffn: FfnSpec = FFN_NONE

    @property
    def letter(self) -> str:
        if not self.mixers:
            return NO_MIXER
        return self.mixers[0].letter if len(self.mixers) == 1 else MULTI_MIXER

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(m.kind for m in self.mixers)

    @property
    def mixer_names(self) -> tuple[str, ...]:
        """Each mixer's module path in the block: "mixer" alone, "mixer.<kind>" side by side."""
        if len(self.mixers) == 1:
            return ("mixer",)
        if len(set(self.kinds)) != len(self.mixers):
            raise ValueError(f"layer {self.index}: two side-by-side mixers of one kind ({', '.join(self.kinds)})")
        return tuple(f"mixer.{kind}" for kind in self.kinds)


@dataclass(frozen=True, slots=True)
class ParamEstimate:
    """Parameter count estimated from the config (norms and biases included where known)."""

    attention: int = 0  # attention and MLA mixers
    linear_mixers: int = 0  # Gated DeltaNet, KDA, Mamba-2, Mamba-1, short conv
    mlp: int = 0  # dense FFNs
    moe_experts: int = 0  # routed experts, routers and shared experts
    embeddings: int = 0  # input embedding, LM head (unless tied), final norm

    @property
    def total(self) -> int:
        return self.attention + self.linear_mixers + self.mlp + self.moe_experts + self.embeddings


@dataclass(frozen=True)
class ModelPlan:
    """A model as the planner, the model builder and the engine see it (see the module docstring)."""

    name: str  # display name: bundled short name, `_name_or_path`, or the checkpoint folder
    model_type: str  # the config's top-level model_type (e.g. "qwen3_5", whose text model is nested)
    hidden_size: int
    vocab_size: int
    num_layers: int
    max_position_embeddings: int | None  # None where the config has no limit (e.g. mamba2)
    dtype: str  # model dtype (weights, KV, conv): canonical name, e.g. "bfloat16"
    state_dtype: str  # recurrent-state dtype: mamba_ssm_dtype / mamba_ssm_cache_dtype, else float32
    tie_word_embeddings: bool
    params: ParamEstimate
    layers: tuple[LayerSpec, ...]
    source: str = field(default="", compare=False)  # where the config came from (for messages)
    # the HF dict the family read: flat, with a nested text_config merged in (outer dtype/tie folded)
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # multi-token-prediction blocks (Qwen3.5 / Qwen3-Next `mtp.*`, config `mtp_num_hidden_layers`):
    # full-attention blocks indexed after the decoder's, run only as a speculative drafter (docs/mtp.md)
    mtp: tuple[LayerSpec, ...] = ()

    def __post_init__(self) -> None:
        if len(self.layers) != self.num_layers:
            raise ValueError(f"{self.name}: {len(self.layers)} layer specs for num_layers={self.num_layers}")
        if any(layer.index != i for i, layer in enumerate(self.layers)):
            raise ValueError(f"{self.name}: layer indices must be 0..{self.num_layers - 1} in order")

    @property
    def layer_string(self) -> str:
        """One letter per block, e.g. "GGGA" * 6 for Qwen3.5-0.8B (letters in the module docstring)."""
        return "".join(layer.letter for layer in self.layers)

    @property
    def mixer_counts(self) -> dict[str, int]:
        """Mixers per kind, e.g. {"gated_deltanet": 18, "attention": 6}; "none" counts mixer-less blocks."""
        counts: Counter[str] = Counter()
        for layer in self.layers:
            counts.update(layer.kinds or ("none",))
        return dict(counts)

    def mixers(self, kind: str) -> list[tuple[int, MixerSpec]]:
        """(layer index, spec) of every mixer of `kind`."""
        return [(layer.index, m) for layer in self.layers for m in layer.mixers if m.kind == kind]
