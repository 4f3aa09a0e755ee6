"""Shared checks of a kvstate model against the transformers model that saved the checkpoint.

Each family test builds a tiny random transformers model, saves it with save_pretrained into a
temp dir, loads it with kvstate, and runs these checks (all fp32 on CPU):
- full-forward logits equal to a relative error <= 1e-4 (norm of difference / norm of logits);
- prefill then token-by-token decode equals the full forward;
- greedy generation of 32 tokens gives exactly transformers' generate() tokens;
- a packed batch of 3 sequences of different lengths equals each run alone.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from kvstate.models.batch import Batch
from kvstate.models.generate import contiguous_caches, forward_logits, greedy_generate
from kvstate.models.loader import load_model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def save_and_load(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    model, plan = load_model(tmp_path)
    return model, plan


def redraw_weights(model: torch.nn.Module, seed: int) -> None:
    """Redraw a tiny model's weights at unit scale, so that a wrong detail moves the logits.

    transformers' init (std 0.02) leaves every mixer's output far below the residual stream.
    Matrices (and fused expert stacks) become N(0, 1/fan_in); vectors keep their init plus noise:
    0.1 for norm weights (ones- or zero-centred alike), 0.3 for A_log, 0.5 for biases, D, dt_bias.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() >= 2 and not name.endswith("A_log"):
                p.copy_(noise / p.shape[-1] ** 0.5)
            else:
                p.add_(noise * (0.1 if "norm" in name else 0.3 if name.endswith("A_log") else 0.5))


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
