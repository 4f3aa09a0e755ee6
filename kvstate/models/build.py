"""Build the generic hybrid decoder from a layer plan and the family's model options.

Each mixer spec class maps to one layer class (`MIXERS`) with a `from_spec(spec, hidden_size,
options)` constructor; each FFN kind to the MLP or MoE modules. The model keeps its plan: its
cache pools are allocated from the plan's cache spec (`kvstate.cache`), never from the layers.
The modules are created on the meta device (no time spent on random init); the loader then
materializes and fills them. Every projection is a `kvstate.kernels.Linear` (the decode kernels
for few rows, torch's GEMM otherwise); `set_weight_dtype` stores the projection, expert and
embedding matrices in bf16 (math stays fp32), everything small (norms, convs, A_log) in fp32.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from kvstate.config.options import ModelOptions
from kvstate.config.plan import (
    AttentionSpec,
    FfnSpec,
    GatedDeltaNetSpec,
    KDASpec,
    Mamba1Spec,
    Mamba2Spec,
    MLASpec,
    ModelPlan,
    ShortConvSpec,
)
from kvstate.errors import KvstateError
from kvstate.kernels import Linear
from kvstate.layers.attention import Attention
from kvstate.layers.gated_deltanet import GatedDeltaNet
from kvstate.layers.kda import KimiDeltaAttention
from kvstate.layers.mamba1 import Mamba1
from kvstate.layers.mamba2 import Mamba2
from kvstate.layers.mla import MLA
from kvstate.layers.mlp import MLP, GatedMLP
from kvstate.layers.moe import MoE
from kvstate.layers.norm import RMSNorm
from kvstate.layers.short_conv import ShortConv
from kvstate.models.decoder import Block, HybridDecoder, ParallelMixers
from kvstate.models.mtp import MtpHead

# mixer spec kind -> its layer, sized by `from_spec(spec, hidden_size, options)`
MIXERS: dict[type, type[nn.Module]] = {
    AttentionSpec: Attention,
    GatedDeltaNetSpec: GatedDeltaNet,
    MLASpec: MLA,
    KDASpec: KimiDeltaAttention,
    Mamba2Spec: Mamba2,
    Mamba1Spec: Mamba1,
    ShortConvSpec: ShortConv,
}


def mixer_class(spec) -> type[nn.Module]:
    if type(spec) not in MIXERS:
        have = ", ".join(cls.kind for cls in MIXERS)
        raise KvstateError(f"mixer kind {spec.kind!r} has no model implementation (have: {have})")
    return MIXERS[type(spec)]


def build_ffn(spec: FfnSpec, hidden: int, opts: ModelOptions):
    if spec.kind == "none":
        return None
    if spec.kind == "mlp":
        if spec.gated:
            return GatedMLP(hidden, spec.intermediate_size, act=opts.act, bias=spec.bias, scales=opts.mlp_scales)
        return MLP(hidden, spec.intermediate_size, act=opts.act, bias=spec.bias)
    return MoE(hidden, spec.num_experts, spec.experts_per_token, spec.expert_intermediate_size,
               router=opts.router, gated=spec.gated, act=opts.act,
               shared_intermediate_size=spec.shared_intermediate_size, shared_gate=opts.shared_expert_gate,
               latent_size=spec.latent_size)


def build_model(plan: ModelPlan, opts: ModelOptions, *, device: str | torch.device = "meta",
                mtp: bool = False) -> HybridDecoder:
    """`mtp`: with the plan's multi-token-prediction head as `model.mtp` (kvstate.models.mtp)."""
    norm = partial(RMSNorm, plan.hidden_size, opts.norm_eps, offset=opts.norm_offset)
    with torch.device(device):
        blocks = [_block(plan, layer, opts, norm) for layer in plan.layers]
        model = HybridDecoder(plan.vocab_size, plan.hidden_size, blocks, norm,
                              tie_word_embeddings=plan.tie_word_embeddings, plan=plan,
                              embedding_scale=opts.embedding_scale, logits_scale=opts.logits_scale)
        if mtp and plan.mtp:
            if len(plan.mtp) > 1:
                raise KvstateError(f"{plan.name}: mtp_num_hidden_layers is {len(plan.mtp)}; kvstate runs one MTP block")
            model.mtp = MtpHead(plan.hidden_size, _block(plan, plan.mtp[0], opts, norm), norm)
    return use_kernel_linears(model)


def _block(plan: ModelPlan, layer, opts: ModelOptions, norm) -> Block:
    """One block; several mixers side by side become one ParallelMixers (the plan's `mixer_names`)."""
    mixers = {spec.kind: mixer_class(spec).from_spec(spec, plan.hidden_size, opts) for spec in layer.mixers}
    if len(mixers) != len(layer.mixers):
        raise KvstateError(f"{plan.name}: layer {layer.index} has two mixers of one kind ({', '.join(layer.kinds)})")
    mixer = next(iter(mixers.values())) if len(mixers) == 1 else ParallelMixers(mixers, opts.mixer_scales) \
        if mixers else None
    return Block(mixer, build_ffn(layer.ffn, plan.hidden_size, opts), norm)


def use_kernel_linears(model: nn.Module) -> nn.Module:
    """Every nn.Linear of `model` becomes a kernels.Linear sharing its parameters (tied ones stay tied)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Linear.from_linear(child))
    return model


# The big matrices a decode step streams, besides every kernels.Linear weight: (module type, parameter).
def _matrices(model: nn.Module):
    from kvstate.layers.moe import Experts

    seen: set[int] = set()
    for module in model.modules():
        names = ("weight",) if isinstance(module, (Linear, nn.Embedding)) else ()
        if isinstance(module, Experts):
            names = ("gate_up", "down")
        for name in names:
            param = getattr(module, name)
            if id(param) not in seen:  # a tied head and embedding are one tensor
                seen.add(id(param))
                yield module, name, param


# Projections of one input that run as one kernel call (`kvstate.kernels.fused`), per layer class;
# the layers' forwards call them through `project` in the same order.
FUSED = {
    GatedDeltaNet: ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    Attention: ("q_proj", "k_proj", "v_proj"),
    GatedMLP: ("gate_proj", "up_proj"),
    KimiDeltaAttention: ("qkv_proj", "f_a_proj", "b_proj", "g_a_proj"),
}


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse every layer's same-input projections (after loading: weights become views of the fused matrix)."""
    from kvstate.kernels.fused import fuse

    for module in model.modules():
        names = FUSED.get(type(module))
        if names:
            fuse(*(getattr(module, n) for n in names))
    return model


def set_weight_dtype(model: nn.Module, weight_dtype: torch.dtype) -> nn.Module:
    """Store the projection, expert and embedding matrices in `weight_dtype` (float32 or bfloat16;
    the kernels widen bf16 exactly, math stays fp32). Tied tensors stay one tensor."""
    if weight_dtype not in (torch.float32, torch.bfloat16):
        raise KvstateError(f"weight dtype {weight_dtype} is not supported (use float32 or bfloat16)")
    if any(p.dtype in (torch.int8, torch.uint8) for _, _, p in _matrices(model)):  # a cast would drop the scales
        raise KvstateError("the model's projections are int8 or GGML blocks: load the checkpoint again in the "
                           "dtype you want")
    converted: dict[int, nn.Parameter] = {}
    for module, name, param in list(_matrices(model)):
        if param.dtype == weight_dtype:
            continue
        new = nn.Parameter(param.detach().to(weight_dtype), requires_grad=param.requires_grad)
        converted[id(param)] = new
    for module in model.modules():  # every holder of a converted tensor (tied head and embedding)
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) in converted:
                setattr(module, name, converted[id(param)])
    return model
