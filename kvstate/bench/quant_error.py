"""How far int8 weights move a model's logits: the int8 model against the same checkpoint in fp32.

`kvstate bench engine --weight-dtype int8` prints it beside the speed, so the bytes int8 saves are
never quoted without what they cost.
"""

from __future__ import annotations

import gc

import torch


def logit_error(path, model, ids: list[int]) -> dict:
    """{"rel": ||logits - fp32 logits|| / ||fp32 logits|| over every position of `ids`,
    "max_rel": the worst position's, "top1": fraction of positions whose argmax agrees}."""
    from kvstate.models.generate import forward_logits
    from kvstate.models.loader import load_model

    ref, _ = load_model(path, weight_dtype="float32")
    with torch.no_grad():
        ours = forward_logits(model, [ids])[0].double()
        truth = forward_logits(ref, [ids])[0].double()
    del ref
    gc.collect()  # fused projections and their groups refer to each other: free the fp32 copy now
    return _compare(ours, truth, len(ids))


def activation_error(model, ids: list[int], name: str) -> dict:
    """The same comparison for `kernels.activation.set_activation_dtype(name)` against the exact mode
    (fp32 math) on the same weights; `ids` at most MAX_ROWS_BF16 long, so every linear runs the kernel."""
    from kvstate.kernels.activation import set_activation_dtype
    from kvstate.models.generate import forward_logits

    with torch.no_grad():
        set_activation_dtype("fp32")
        truth = forward_logits(model, [ids])[0].double()
        set_activation_dtype(name)
        ours = forward_logits(model, [ids])[0].double()
    return _compare(ours, truth, len(ids))


def _compare(ours: torch.Tensor, truth: torch.Tensor, positions: int) -> dict:
    per_pos = (ours - truth).norm(dim=-1) / truth.norm(dim=-1).clamp_min(1e-30)
    return dict(rel=float((ours - truth).norm() / truth.norm()), max_rel=float(per_pos.max()),
                top1=float((ours.argmax(-1) == truth.argmax(-1)).double().mean()), positions=positions)
