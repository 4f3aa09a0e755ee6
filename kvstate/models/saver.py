"""Save a loaded kvstate model back as a Hugging Face checkpoint (config.json + model.safetensors).

Each checkpoint tensor is rebuilt from our parameters through the same `weight_targets` the
loader used (the inverse of loading), in the layout recorded at load time, so transformers'
`from_pretrained` reads the result.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvstate.errors import KvstateError
from kvstate.models.loader import family_of


def save_checkpoint(model, plan, path: str | Path) -> Path:
    layout = getattr(model, "checkpoint_layout", None)
    if not layout:
        raise KvstateError("only a model loaded from a checkpoint can be saved (its tensor layout is unknown)")
    family = family_of(plan)
    params = dict(model.named_parameters())
    params.update(model.named_buffers())
    if plan.tie_word_embeddings:
        params.setdefault("lm_head.weight", model.embed_tokens.weight)
    tensors = {}
    for key, shape in layout.items():
        out = torch.empty(shape, dtype=model.embed_tokens.weight.dtype)
        for t in family.weight_targets(key, plan):
            region = params[t.name][t.index] if t.index else params[t.name]
            rows = list(t.rows) if isinstance(t.rows, tuple) else t.rows
            if rows is None:
                out.copy_(region.reshape(shape))
            else:
                out[rows] = region.reshape(out[rows].shape)
        tensors[key] = out.contiguous()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(model.hf_config, indent=2))
    return path
