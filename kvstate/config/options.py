"""What the model builder needs beyond the layer plan (no torch): norms, positions, activations, routing.

The layer plan says which mixer and FFN each block has and the dims that size them; a family
adapter's `model_options(cfg)` adds the numerical conventions its HF implementation uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelOptions:
    norm_eps: float = 1e-6
    norm_offset: float = 0.0  # 1.0: zero-centred RMSNorm weights, y = (1 + w) * x / rms(x) (Qwen3.5, Qwen3-Next)
    act: str = "silu"  # FFN activation (experts and shared experts too)
    rope_theta: float | None = 10000.0  # None: attention without positional encoding (Jamba, Nemotron-H)
    partial_rotary_factor: float = 1.0  # fraction of each head's dims that rotate
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3", "factor": 8, ...}
    router: dict[str, Any] = field(default_factory=dict)  # kvstate.layers.moe.Router keyword arguments
    shared_expert_gate: bool = False  # shared expert output scaled by sigmoid(linear(x)) (Qwen)
    mixer: dict[str, dict[str, Any]] = field(default_factory=dict)  # per mixer kind, e.g. {"mamba2": {...}}
    # Falcon-H1's multipliers: per kind (input, output) of side-by-side mixers; the gate and down
    # projections' outputs of the MLP; the embeddings; the logits
    mixer_scales: dict[str, tuple[float, float]] = field(default_factory=dict)
    mlp_scales: tuple[float, float] = (1.0, 1.0)
    embedding_scale: float = 1.0
    logits_scale: float = 1.0

    def for_mixer(self, kind: str) -> dict[str, Any]:
        return dict(self.mixer.get(kind, {}))
