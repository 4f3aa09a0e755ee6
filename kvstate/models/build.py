"""Build the generic hybrid decoder from a layer plan and the family's model options.

Each mixer kind maps to one layer class with a `from_spec(spec, hidden_size, options)`
constructor; each FFN kind to the MLP or MoE modules. The modules are created on the meta
device (no time spent on random init); the loader then materializes and fills them.
"""

from __future__ import annotations

import importlib
from functools import partial

import torch

from kvstate.config.options import ModelOptions
from kvstate.config.plan import FfnSpec, ModelPlan
from kvstate.errors import KvstateError
from kvstate.layers.mlp import MLP, GatedMLP
from kvstate.layers.moe import MoE
from kvstate.layers.norm import RMSNorm
from kvstate.models.decoder import Block, HybridDecoder

# mixer kind -> "module:Class" in kvstate.layers
MIXERS = {
    "attention": "kvstate.layers.attention:Attention",
    "gated_deltanet": "kvstate.layers.gated_deltanet:GatedDeltaNet",
    "mla": "kvstate.layers.mla:MLA",
    "kda": "kvstate.layers.kda:KimiDeltaAttention",
    "mamba2": "kvstate.layers.mamba2:Mamba2",
    "mamba1": "kvstate.layers.mamba1:Mamba1",
}


def mixer_class(kind: str):
    if kind not in MIXERS:
        raise KvstateError(f"mixer kind {kind!r} has no model implementation (have: {', '.join(MIXERS)})")
    module, name = MIXERS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def build_ffn(spec: FfnSpec, hidden: int, opts: ModelOptions):
    if spec.kind == "none":
        return None
    if spec.kind == "mlp":
        cls = GatedMLP if spec.gated else MLP
        return cls(hidden, spec.intermediate_size, act=opts.act, bias=opts.mlp_bias)
    return MoE(hidden, spec.num_experts, spec.experts_per_token, spec.expert_intermediate_size,
               router=opts.router, gated=spec.gated, act=opts.act,
               shared_intermediate_size=spec.shared_intermediate_size, shared_gate=opts.shared_expert_gate,
               latent_size=spec.latent_size)


def build_model(plan: ModelPlan, opts: ModelOptions, *, device: str | torch.device = "meta") -> HybridDecoder:
    norm = partial(RMSNorm, plan.hidden_size, opts.norm_eps, offset=opts.norm_offset)
    with torch.device(device):
        blocks = []
        for layer in plan.layers:
            if len(layer.mixers) > 1:
                raise KvstateError(f"{plan.name}: layer {layer.index} has parallel mixers "
                                   f"({', '.join(layer.kinds)}), which the model does not run yet")
            mixer = None
            if layer.mixers:
                spec = layer.mixers[0]
                mixer = mixer_class(spec.kind).from_spec(spec, plan.hidden_size, opts)
            blocks.append(Block(mixer, build_ffn(layer.ffn, plan.hidden_size, opts), norm))
        return HybridDecoder(plan.vocab_size, plan.hidden_size, blocks, norm,
                             tie_word_embeddings=plan.tie_word_embeddings, layer_string=plan.layer_string)
