"""The explorer's recall panel, side by side: one needle or phone-book prompt scored by two models.

The served model is one side; the other is any checkpoint kvstate can load (default: the other
shipped model, `kvstate-phonebook-linear` beside the hybrid), loaded on demand into a small
least-recently-used cache (`ModelCache`, at most two models besides the served one). Each side
gets the prompt in its own format: a checkpoint with a chat template (the shipped models were
trained on phone books in Qwen's chat format) sees the prompt as the user message and the reply
started as it was trained to answer ("Name Surname: " for a phone book), a plain checkpoint the
raw text. Candidates are scored by `explorer_recall.score` (one packed forward, the model's own
probabilities). Each side also reports its layer string and the cache it would hold for that
prompt (KV bytes grow with the prompt, state bytes do not), and a note where the task is outside
what kvstate knows the model was trained on.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from kvstate.errors import KvstateError

MAX_CACHED = 2


class ModelCache:
    """Loaded (model, tokenizer, plan) by checkpoint directory; the least recently used goes first."""

    def __init__(self, size: int = MAX_CACHED):
        self.size, self.models = size, OrderedDict()
        self.lock = threading.Lock()

    def get(self, name: str):
        from kvstate.hub import resolve_checkpoint
        from kvstate.models.loader import load_model
        from kvstate.models.tokenizer import Tokenizer

        path = resolve_checkpoint(name).resolve()
        with self.lock:
            if path in self.models:
                self.models.move_to_end(path)
                return self.models[path]
            if not (path / "tokenizer.json").is_file():
                raise KvstateError(f"{name}: no tokenizer.json, the recall panel needs one for text prompts")
            model, plan = load_model(path)
            self.models[path] = (model, Tokenizer(path), plan)
            while len(self.models) > self.size:
                self.models.popitem(last=False)
            return self.models[path]


def checkpoint_dir(plan) -> Path | None:
    source = Path(str(getattr(plan, "source", "") or ""))
    return source.parent.resolve() if source.name == "config.json" else None


def shipped_name(plan) -> str | None:
    from kvstate.shipped import SHIPPED, shipped_path

    where = checkpoint_dir(plan)
    for name in SHIPPED:
        path = shipped_path(name)
        if where is not None and path is not None and path.resolve() == where:
            return name
    return None


def default_other(plan) -> str:
    """The other shipped model than the served one (the linear one beside any other served model)."""
    from kvstate.shipped import SHIPPED

    mine = shipped_name(plan)
    return next(n for n in SHIPPED if n != mine) if mine else "kvstate-phonebook-linear"


def training_note(plan, task: str, size: int) -> str | None:
    """Where the task is outside what the model was trained on (as far as kvstate knows)."""
    if shipped_name(plan) is None:
        return "kvstate does not know what this checkpoint was trained on: read its scores with care"
    from kvstate.recall.shipped_training import TrainSettings

    top = TrainSettings().max_entries
    if task != "phonebook":
        return (f"outside its training: the shipped models learned phone books (1-{top} entries) and copying, "
                "never a needle")
    if size > top:
        return f"outside its training: phone books of 1-{top} entries, this one has {size}"
    return None


def prompt_ids(tokenizer, task: str, prompt: str) -> list[int]:
    """The prompt as this model expects it: chat format and the started reply where it has a template."""
    if not tokenizer.chat_template:
        return tokenizer.encode(prompt)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.rstrip()}])
    if task == "phonebook":  # trained to answer "Name Surname: 1234": the name is given, the digits scored
        text += prompt.rsplit("What is ", 1)[1].rsplit("'s number?", 1)[0] + ": "
    return tokenizer.encode(text, add_special_tokens=False)


def side(model, tokenizer, plan, name: str, task: str, size: int, prompt: str, candidates: list[str],
         max_len: int) -> dict:
    """One model's column: its scores, layer string and cache bytes for this prompt."""
    from kvstate.cache.spec import cache_spec
    from kvstate.server.explorer_recall import score_ids

    ids = prompt_ids(tokenizer, task, prompt)
    n, rows = score_ids(model, tokenizer, ids, candidates, max_len)
    spec = cache_spec(plan, kv_dtype="float32", state_dtype="float32", conv_dtype="float32")
    return {"model": name, "layer_string": plan.layer_string, "prompt_tokens": n,
            "chat_format": bool(tokenizer.chat_template), "kv_bytes": spec.kv_bytes_per_token * n,
            "state_bytes": spec.state_bytes, "note": training_note(plan, task, size), "candidates": rows}
