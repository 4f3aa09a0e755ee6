"""Training a multi-token-prediction head (`mtp.*`, kvstate.models.mtp) for a shipped phonebook model.

The target stays frozen: its packed forward (no grad) gives h_p, the last hidden state after the
final norm, at every position; the head learns to predict the token at p + 2 from h_p and the
token at p + 1 (docs/mtp.md), with the cross-entropy at every position whose token two ahead is
part of an assistant reply (phone-book answers and copies), on the same chats the model was
trained on. It is trained on the drafts it chains too (`depth`, kvstate.recall.mtp_unroll): draft
d at p reads the head's own output of draft d - 1 and the true token t_{p+d}, and predicts
t_{p+d+1}; the drafts' cross-entropies are summed with `depth_weights`. `mtp_loss` is draft 1
alone, through the engine's own head forward. The head starts from the target's last
full-attention block (same shapes), fc as [0 | I] (it passes h through) and zero-centred norms,
so step 0 is already a sensible guess.
Seeded: a run is repeatable. The result is written into the checkpoint under the real names
(`mtp.fc.weight`, `mtp.layers.0.*`, ...) with `mtp_num_hidden_layers: 1` in config.json.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kvstate.cache.pools import allocate_pools
from kvstate.cache.spec import cache_spec
from kvstate.models.batch import Batch
from kvstate.models.loader import load_model
from kvstate.models.saver import save_checkpoint
from kvstate.recall.chat_data import copy_chat, encode_chat, phonebook_chat
from kvstate.recall.mtp_unroll import unrolled_logits


@dataclass(frozen=True)
class MtpSettings:
    steps: int = 3200
    batch: int = 16
    lr: float = 3e-3
    max_entries: int = 12  # phone books of 1..max_entries entries
    copy_share: float = 0.3
    copy_weight: float = 0.4  # of a copy chat's tokens in the loss (a phone book's: 1): copies have ~6x the tokens
    copy_words: tuple[int, int] = (8, 64)
    depth: int = 3  # drafts chained in the objective (kvstate.recall.mtp_unroll)
    depth_weights: tuple[float, ...] = (1.0, 0.5, 0.3)  # of each draft's cross-entropy
    copy_depth_scale: tuple[float, ...] = (1.0, 2.0, 3.0)  # copy tokens weigh copy_weight * this in draft d
    warmup: int = 0  # steps of linear lr warm-up before the cosine


def with_mtp_config(src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` in `dst` whose config.json declares one MTP block, its weights
    initialized (see the module docstring) in model.safetensors."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    if src.resolve() != dst.resolve():
        for f in src.iterdir():
            if f.is_file():
                shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = load_file(str(dst / "model.safetensors"))
    tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    full = max(i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention")
    prefix = f"model.layers.{full}."
    for k, v in list(tensors.items()):
        if k.startswith(prefix):
            tensors["mtp.layers.0." + k[len(prefix):]] = v.clone()
    h = cfg["hidden_size"]
    tensors["mtp.fc.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = torch.zeros(h)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _chats(rng, s: MtpSettings):
    out = []
    for _ in range(s.batch):
        if rng.random() < s.copy_share:
            out.append(copy_chat(rng, int(rng.integers(s.copy_words[0], s.copy_words[1] + 1))))
        else:
            out.append(phonebook_chat(rng, int(rng.integers(1, s.max_entries + 1))))
    return out


def _packed(model, seqs: list[list[int]]):
    n, max_len = len(seqs), max(len(s) for s in seqs)
    batch = Batch.build([len(s) for s in seqs], [0] * n, list(range(n)), [[i] for i in range(n)], max_len,
                        logits="all", device=model.device)
    return batch, max_len


def _target_hidden(model, tokenizer, chats, mtp: bool):
    """The frozen target's packed forward over the chats: (encoded chats, max length, the pools (the
    head's KV pool last when `mtp`), its normed last hidden state per token [T, H])."""
    encoded = [encode_chat(tokenizer, c) for c in chats]
    ids = [e[0] for e in encoded]
    batch, max_len = _packed(model, ids)
    spec = cache_spec(model.plan, kv_dtype="float32", state_dtype="float32", conv_dtype="float32", mtp=mtp)
    caches = allocate_pools(spec, num_blocks=len(ids), block_size=max_len, num_slots=len(ids))
    flat = torch.tensor([t for s in ids for t in s], dtype=torch.int64)
    with torch.no_grad():
        _, hidden = model(flat, batch, caches[:-1] if mtp else caches, hidden=True)  # [T, H]
    return encoded, max_len, caches, hidden


def mtp_loss(model, tokenizer, chats) -> tuple[torch.Tensor, float]:
    """(cross-entropy of the head at the reply tokens two ahead, share of them it gets right)."""
    encoded, _, caches, hidden = _target_hidden(model, tokenizer, chats, mtp=True)
    ids = [e[0] for e in encoded]
    # head position p of sequence i: h_p and token p + 1 -> token p + 2 (sequences one shorter)
    rows, nxt, target, offset = [], [], [], 0
    for s, trained in encoded:
        for p in range(len(s) - 1):
            rows.append(offset + p)
            nxt.append(s[p + 1])
            target.append(s[p + 2] if p + 2 < len(s) and trained[p + 2] else -100)
        offset += len(s)
    hb, _ = _packed(model, [s[:-1] for s in ids])
    hb.logits_indices = torch.arange(len(rows))
    logits, _ = model.mtp(torch.tensor(nxt), hidden[torch.tensor(rows)], hb, caches[-1], model.embed_tokens,
                          model.lm_head)
    target = torch.tensor(target)
    keep = target != -100
    loss = F.cross_entropy(logits[keep], target[keep])
    acc = float((logits[keep].argmax(-1) == target[keep]).float().mean())
    return loss, acc


def unrolled_loss(model, tokenizer, chats, depth: int, weights, copy_weight: float = 1.0,
                  copy_scale: tuple[float, ...] | None = None) -> tuple[torch.Tensor, list[float]]:
    """(weighted cross-entropy of drafts 1 .. depth at reply tokens, share right per draft): draft d at
    row p predicts t_{p+d+1}, chained on the head's own output (kvstate.recall.mtp_unroll); a copy
    chat's tokens count `copy_weight` (times `copy_scale[d - 1]` in draft d)."""
    encoded, max_len, _, hidden = _target_hidden(model, tokenizer, chats, mtp=False)
    ids = [e[0] for e in encoded]
    b = len(ids)
    padded = torch.zeros(b, max_len, hidden.shape[-1])
    tokens = torch.zeros(b, max_len, dtype=torch.int64)
    trained = torch.zeros(b, max_len, dtype=torch.bool)
    offset = 0
    for i, (s, tr) in enumerate(encoded):
        padded[i, : len(s)] = hidden[offset : offset + len(s)]
        tokens[i, : len(s)] = torch.tensor(s)
        trained[i, : len(s)] = torch.tensor(tr)
        offset += len(s)
    is_copy = torch.tensor([c.kind == "copy" for c in chats])[:, None].expand(b, max_len)  # [B, T]
    loss, accs = torch.zeros(()), []
    for d, logits in enumerate(unrolled_logits(model, padded, tokens, depth), start=1):
        target = F.pad(tokens[:, d + 1 :], (0, d + 1))  # [B, T]: t_{p+d+1}
        keep = F.pad(trained[:, d + 1 :], (0, d + 1))
        scale = 1.0 if copy_scale is None else copy_scale[d - 1]
        w = torch.where(is_copy, copy_weight * scale, 1.0)[keep]
        ce = F.cross_entropy(logits[keep], target[keep], reduction="none")
        loss = loss + weights[d - 1] * (w * ce).sum() / w.sum()
        accs.append(float((logits[keep].argmax(-1) == target[keep]).float().mean()))
    return loss, accs


STATE = "mtp_train_state.pt"  # in `out` while a run in chunks is unfinished


def train_mtp(checkpoint: Path, out: Path, settings: MtpSettings = MtpSettings(), *, seed: int = 0,
              log=None, chunk: int | None = None) -> dict:
    """Train the head of `checkpoint`'s model (frozen) and write the model with it to `out` (may be
    `checkpoint` itself: its head is then retrained from the initialization above). One CPU thread:
    these matrices gain nothing from a second, and the machine is shared. With `chunk`, at most that
    many steps run; an unfinished run leaves its state (head, optimiser, schedule, data rng) in
    `out`/STATE and the next call with the same settings and seed continues it, to the very same
    head as one call. {"steps": steps done, "done": whether the head was written}."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(Path(checkpoint), Path(out), settings, seed, log, chunk)
    finally:
        torch.set_num_threads(threads)


def _train(checkpoint: Path, out: Path, settings: MtpSettings, seed: int, log, chunk: int | None) -> dict:
    from tokenizers import Tokenizer

    key = repr((settings, seed))
    state = torch.load(out / STATE, weights_only=False) if (out / STATE).is_file() else None
    if state is not None and state["key"] != key:
        state = None  # another run's: start afresh
    work = with_mtp_config(checkpoint, out) if state is None else out
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model, plan = load_model(work, weight_dtype="float32")
    tokenizer = Tokenizer.from_file(str(work / "tokenizer.json"))
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp."))
    params = [p for p in model.mtp.parameters()]
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, settings.steps - settings.warmup, eta_min=settings.lr / 10)
    sched = cosine if settings.warmup == 0 else torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, 1 / settings.warmup, 1.0, settings.warmup), cosine],
        [settings.warmup])
    start = 0
    if state is not None:
        with torch.no_grad():
            model.mtp.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        rng.bit_generator.state = state["rng"]
        torch.set_rng_state(state["torch_rng"])
        start = state["step"]
    end = settings.steps if chunk is None else min(settings.steps, start + chunk)
    acc = 0.0
    for step in range(start, end):
        loss, accs = unrolled_loss(model, tokenizer, _chats(rng, settings), settings.depth, settings.depth_weights,
                                   settings.copy_weight, settings.copy_depth_scale)
        acc = accs[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if log is not None and step % 25 == 0:
            log(step, float(loss.detach()), acc)
    if end < settings.steps:
        torch.save(dict(key=key, step=end, head=model.mtp.state_dict(), opt=opt.state_dict(),
                        sched=sched.state_dict(), rng=rng.bit_generator.state, torch_rng=torch.get_rng_state()),
                   out / STATE)
        return {"steps": end, "done": False, "train_acc_last": acc}
    model.eval()
    save_checkpoint(model, plan, work)
    (out / STATE).unlink(missing_ok=True)
    return {"steps": settings.steps, "done": True, "train_acc_last": acc}
