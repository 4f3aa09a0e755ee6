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
    per_pos = (ours - truth).norm(dim=-1) / truth.norm(dim=-1).clamp_min(1e-30)
    return dict(rel=float((ours - truth).norm() / truth.norm()), max_rel=float(per_pos.max()),
                top1=float((ours.argmax(-1) == truth.argmax(-1)).double().mean()), positions=len(ids))
