"""Mixture of experts with the routers of the hybrid families.

Routers:
- "softmax": softmax over all experts, top-k, optionally renormalized (Qwen3.5-MoE, Qwen3-Next,
  Jamba without renormalization).
- "sigmoid": sigmoid scores, top-k chosen on score + correction bias within the best groups,
  weights from the raw scores, optionally renormalized, times a scaling factor (Kimi Linear,
  Nemotron-H; DeepSeek-V3 style).
Experts are stored fused: gate_up [E, 2I, H] and down [E, H, I] (gated, SwiGLU) or up [E, I, H]
(plain, Nemotron's relu^2). Shared experts are a dense MLP added to every token, optionally
scaled by sigmoid(shared_expert_gate(x)) (Qwen). A latent MoE (Nemotron) routes on x but runs the
experts on fc1_latent_proj(x) and maps their sum back with fc2_latent_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvstate.kernels import linear
from kvstate.kernels.blocks import block_linear
from kvstate.layers.mlp import MLP, GatedMLP, activation


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, kind: str = "softmax",
                 norm_topk: bool = True, num_groups: int = 1, topk_groups: int = 1, scaling: float = 1.0):
        super().__init__()
        self.num_experts, self.top_k, self.kind = num_experts, top_k, kind
        self.norm_topk, self.num_groups, self.topk_groups, self.scaling = norm_topk, num_groups, topk_groups, scaling
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        if kind == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k])."""
        logits = F.linear(x.float(), self.weight.float())
        if self.kind == "softmax":
            probs = logits.softmax(dim=-1)
            weights, ids = probs.topk(self.top_k, dim=-1)
            if self.norm_topk:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights, ids
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.num_groups > 1:
            grouped = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_groups, dim=-1)[1], 1)
            choice = choice.masked_fill(~keep.bool().repeat_interleave(self.num_experts // self.num_groups, 1),
                                        float("-inf"))
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class Experts(nn.Module):
    # GGML block types when a GGUF file's expert tensors stay blocks (uint8 [E, rows, bytes per row]:
    # `models.gguf_blocks`); None for float weights
    gate_up_format: str | None = None
    down_format: str | None = None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, gated: bool = True,
                 act: str = "silu"):
        super().__init__()
        self.num_experts, self.gated = num_experts, gated
        rows = 2 * intermediate_size if gated else intermediate_size
        self.gate_up = nn.Parameter(torch.empty(num_experts, rows, hidden_size))  # "up" alone when not gated
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = activation(act)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x, dtype=torch.float32)
        order = ids.flatten().argsort(stable=True)  # token-slots grouped by expert
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts).tolist()
        token_of = order // ids.shape[1]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            tokens = token_of[start : start + n]
            start += n
            h = _project(x[tokens], self.gate_up[e], self.gate_up_format)  # bf16 weights widened, blocks exact
            if self.gated:
                g, u = h.chunk(2, dim=-1)
                h = self.act(g) * u
            else:
                h = self.act(h)
            y = _project(h, self.down[e], self.down_format) * weights.flatten()[sel, None]
            out.index_add_(0, tokens, y.float())
        return out.to(x.dtype)


def _project(x: torch.Tensor, weight: torch.Tensor, block_type: str | None) -> torch.Tensor:
    """x @ weight^T: the kernels' linear, or `block_linear` for one expert's GGML blocks."""
    return linear(x, weight) if block_type is None else block_linear(x, weight, None, block_type)


class MoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, *,
                 router: dict | None = None, gated: bool = True, act: str = "silu",
                 shared_intermediate_size: int = 0, shared_gate: bool = False, latent_size: int = 0):
        super().__init__()
        self.gate = Router(hidden_size, num_experts, top_k, **(router or {}))
        # latent MoE (Nemotron): the routed experts run in latent_size, between two projections
        self.fc1_latent_proj = nn.Linear(hidden_size, latent_size, bias=False) if latent_size else None
        self.fc2_latent_proj = nn.Linear(latent_size, hidden_size, bias=False) if latent_size else None
        self.experts = Experts(num_experts, latent_size or hidden_size, intermediate_size, gated=gated, act=act)
        self.shared_experts = None
        if shared_intermediate_size:
            cls = GatedMLP if gated else MLP
            self.shared_experts = cls(hidden_size, shared_intermediate_size, act=act)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.fc1_latent_proj is None:
            out = self.experts(x, weights, ids)
        else:
            out = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), weights, ids))
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
