"""Training through kvstate's model: autograd over the packed forward gives transformers' gradients.

The recall models (`kvstate.recall`) are trained with the same decoder the engine runs, so its
backward must be right: every checkpoint tensor's gradient, gathered through the loader's
`weight_targets`, equals the gradient of transformers' model on the same tokens.
"""

import torch
import torch.nn.functional as F
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from kvstate.models.batch import Batch
from kvstate.models.generate import contiguous_caches
from kvstate.models.loader import family_of
from tests.models.checks import redraw_weights, rel_err, save_and_load
from tests.models.test_qwen3_5 import TEXT, VOCAB


def checkpoint_grads(model, plan) -> dict[str, torch.Tensor]:
    """Each checkpoint tensor's gradient, assembled from our parameters' grads as the saver assembles weights."""
    family, params = family_of(plan), dict(model.named_parameters())
    if plan.tie_word_embeddings:
        params.setdefault("lm_head.weight", model.embed_tokens.weight)
    out = {}
    for key, shape in model.checkpoint_layout.items():
        g = torch.zeros(shape)
        for t in family.weight_targets(key, plan):
            grad = params[t.name].grad
            region = grad[t.index] if t.index else grad
            rows = list(t.rows) if isinstance(t.rows, tuple) else t.rows
            if rows is None:
                g.copy_(region.reshape(shape))
            else:
                g[rows] = region.reshape(g[rows].shape)
        out[key] = g
    return out


def test_gradients_equal_transformers(tmp_path):
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=96, **TEXT))
    redraw_weights(hf, 0)
    model, plan = save_and_load(hf, tmp_path)  # fused projections: training must run them apart
    b, t = 3, 40
    ids = torch.randint(0, VOCAB, (b, t))
    batch = Batch.build([t] * b, [0] * b, list(range(b)), [[i] for i in range(b)], t, logits="all")
    logits = model(ids.flatten(), batch, contiguous_caches(model, b, t)).view(b, t, -1)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    hf.train()
    ref = hf(ids).logits
    F.cross_entropy(ref[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()

    ours, theirs = checkpoint_grads(model, plan), dict(hf.named_parameters())
    assert ours.keys() == {k for k, p in theirs.items() if p.grad is not None} | ours.keys()
    for key, g in ours.items():
        assert theirs[key].grad is not None, key
        assert rel_err(g, theirs[key].grad) < 1e-4, key
