"""Shared checks of a kvstate model against the transformers model that saved the checkpoint.

Each family test builds a tiny random transformers model, saves it with save_pretrained into a
temp dir, loads it with kvstate, and runs these checks (all fp32 on CPU):
- full-forward logits equal to a relative error <= 1e-4 (norm of difference / norm of logits);
- prefill then token-by-token decode equals the full forward;
- greedy generation of 32 tokens gives exactly transformers' generate() tokens;
- a packed batch of 3 sequences of different lengths equals each run alone.

Also shared: `redraw_weights` (unit-scale random weights for the tiny models), `rewrite_checkpoint` /
`check_load_fails` (a saved checkpoint edited tensor by tensor), and `check_plan_matches_model` /
`check_bundled_config_builds_as_planned` (a model's layers and parameters are the planner's).
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvstate.families import read_plan
from kvstate.config.fields import ConfigView
from kvstate.errors import KvstateError
from kvstate.models.batch import Batch
from kvstate.models.build import build_model
from kvstate.models.generate import contiguous_caches, forward_logits
from tests.greedy import greedy_generate
from kvstate.models.loader import family_of, load_model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def save_and_load(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    model, plan = load_model(tmp_path)
    return model, plan


def tiny_model(model_class, config_class, seed: int, **config):
    """transformers' `model_class(config_class(**config))` in eval mode, its weights redrawn at unit scale."""
    torch.manual_seed(seed)
    hf = model_class(config_class(**config)).eval()
    redraw_weights(hf, seed)
    return hf


def redraw_weights(model: torch.nn.Module, seed: int) -> None:
    """Redraw a tiny model's weights at unit scale, so that a wrong detail moves the logits.

    transformers' init (std 0.02) leaves every mixer's output far below the residual stream.
    Parameters and persistent buffers (e.g. the MoE routers' e_score_correction_bias; not
    rotary inv_freq, which is recomputed, not saved):
    - A_log: its init (the decay rates' spread) plus N(0, 0.3);
    - dt_bias: U(-2, 0), so that softplus(dt + dt_bias) stays far from any time-step clamp;
    - norm weights: their init plus N(0, 0.1) (ones-centred and Qwen's zero-centred (1 + w) alike);
    - matrices (and fused expert stacks, conv kernels): N(0, 1/fan_in);
    - other float vectors (D, biases, correction biases): their init plus N(0, 0.5).
    """
    g = torch.Generator().manual_seed(seed)
    saved = model.state_dict().keys()
    buffers = [(name, b) for name, b in model.named_buffers() if name in saved]
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + buffers:
            if not p.is_floating_point():
                continue
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("A_log"):
                p.add_(0.3 * noise)
            elif name.endswith("dt_bias"):
                p.copy_(-2 * torch.rand(p.shape, generator=g))
            elif "norm" in name:
                p.add_(0.1 * noise)
            elif p.dim() >= 2:
                p.copy_(noise / p.shape[-1] ** 0.5)
            else:
                p.add_(0.5 * noise)


def rewrite_checkpoint(path, edit, dest=None) -> Path:
    """Load the checkpoint's model.safetensors at `path`, apply `edit(tensors)` (a dict it changes in
    place) and save the result: over the file, or into `dest` (with a copy of config.json) so that
    `path` stays untouched. Returns the directory written."""
    path = Path(path)
    out = path if dest is None else Path(dest)
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if out != path:
        (out / "config.json").write_text((path / "config.json").read_text())
    return out


def check_load_fails(path, edit, match: str, dest=None) -> None:
    """The checkpoint at `path`, rewritten by `edit` (see `rewrite_checkpoint`), fails to load with a
    KvstateError whose message matches the regex `match`."""
    bad = rewrite_checkpoint(path, edit, dest)
    with pytest.raises(KvstateError, match=match):
        load_model(bad)


def check_plan_matches_model(plan, model) -> None:
    """Every layer's mixers (side by side: each of them) are the classes their plan specs map to, built
    from those specs (so their caches are the spec's cache entries), and the model has exactly as many
    parameters as the planner estimates."""
    from kvstate.models.build import mixer_class

    assert model.plan is plan
    for block, layer in zip(model.layers, plan.layers, strict=True):
        assert (block.mixer is None) == (not layer.mixers)
        assert [type(m) for m in block.mixer_modules()] == [mixer_class(spec) for spec in layer.mixers]
    assert sum(p.numel() for p in model.parameters()) == plan.params.total


def build_on_meta(plan):
    """The kvstate model of `plan`, built on the meta device (no memory, any size)."""
    options = family_of(plan).model_options(ConfigView(plan.config, plan.source))
    return build_model(plan, options, device="meta")


def check_bundled_config_builds_as_planned(name):
    """A real config (bundled name or checkpoint dir), built on the meta device, has exactly as many
    parameters as the planner estimates and exactly the cache shapes of its cache spec. -> (model, plan)"""
    plan = read_plan(name)
    model = build_on_meta(plan)
    check_plan_matches_model(plan, model)
    return model, plan


def random_ids(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@torch.inference_mode()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()


def check_full_forward(model, hf_model, vocab: int, length: int = 70, tol: float = 1e-4) -> None:
    ids = random_ids(vocab, length, 0)
    ours = forward_logits(model, [ids])[0]
    ref = hf_logits(hf_model, ids)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) <= tol, rel_err(ours, ref)


@torch.inference_mode()
def check_decode_equals_full(model, vocab: int, prompt_len: int = 37, steps: int = 12, tol: float = 1e-4) -> None:
    ids = random_ids(vocab, prompt_len + steps, 1)
    full = forward_logits(model, [ids])[0]
    max_len = len(ids)
    caches = contiguous_caches(model, 1, max_len)
    batch = Batch.build([prompt_len], [0], [0], [[0]], max_len, logits="all")
    rows = [model(torch.tensor(ids[:prompt_len]), batch, caches)]
    for p in range(prompt_len, len(ids)):
        batch = Batch.build([1], [p], [0], [[0]], max_len)
        rows.append(model(torch.tensor([ids[p]]), batch, caches))
    stepped = torch.cat(rows)
    assert rel_err(stepped, full) <= tol, rel_err(stepped, full)


@torch.inference_mode()
def check_greedy(model, hf_model, vocab: int, prompt_len: int = 11, new: int = 32) -> None:
    ids = random_ids(vocab, prompt_len, 2)
    # an explicit mask: generate() would otherwise mask every prompt token equal to pad_token_id
    mask = torch.ones(1, len(ids), dtype=torch.long)
    ref = hf_model.generate(torch.tensor([ids]), attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, eos_token_id=None, pad_token_id=0)[0, prompt_len:].tolist()
    ours = greedy_generate(model, ids, new)
    assert ours == ref


def check_packed(model, vocab: int, lengths=(23, 5, 41), tol: float = 1e-4) -> None:
    seqs = [random_ids(vocab, n, 10 + i) for i, n in enumerate(lengths)]
    packed = forward_logits(model, seqs)
    for seq, got in zip(seqs, packed):
        alone = forward_logits(model, [seq])[0]
        assert rel_err(got, alone) <= tol, rel_err(got, alone)


def check_all(model, hf_model, vocab: int) -> None:
    check_full_forward(model, hf_model, vocab)
    check_decode_equals_full(model, vocab)
    check_greedy(model, hf_model, vocab)
    check_packed(model, vocab)


def check_saved_loads_in_transformers(model, plan, hf_model, tmp_path, vocab: int) -> None:
    """kvstate saves the checkpoint back; transformers loads it and gives the same logits as before."""
    from kvstate.models.saver import save_checkpoint

    out = save_checkpoint(model, plan, tmp_path / "saved")
    reloaded = type(hf_model).from_pretrained(out, dtype=torch.float32).eval()
    ids = random_ids(vocab, 19, 5)
    assert rel_err(hf_logits(reloaded, ids), hf_logits(hf_model, ids)) <= 1e-6
