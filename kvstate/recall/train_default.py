"""`kvstate recall train-default`: train the two shipped phonebook models, one command, seeded.

Both models are Qwen3.5 text checkpoints of the same size, trained the same way (same seed, same
data stream); they differ only in their layer string: the hybrid `GAGA` (Gated DeltaNet and
full attention alternating; docs/recall.md says why not 3:1), the linear `GGGG`. Each run
writes a fresh checkpoint (`init_checkpoint`), loads it with kvstate's loader, trains it
(`shipped_training`), and saves it with the word-level tokenizer and Qwen's chat template
(`chat_data`) into `<out>/<name>/`, which by default is the package's kvstate/data/models (kvstate.shipped); then
scores its exact phonebook answers by book size and its exact repeats by passage length.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from kvstate.recall.shipped_training import TrainSettings

# the shipped models: name -> layer string; everything else is shared
LAYERS = {"kvstate-phonebook-hybrid": "GAGA", "kvstate-phonebook-linear": "GGGG"}
EVAL_ENTRIES = (1, 2, 4, 8, 16, 32, 64)
EVAL_COPY_WORDS = (4, 16, 64)  # passage lengths of the copy check


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int = 64
    intermediate_size: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    linear_heads: int = 2
    linear_head_dim: int = 32
    tie_word_embeddings: bool = True


@dataclass(frozen=True)
class DefaultRecipe:
    size: ModelSize = field(default_factory=ModelSize)
    train: TrainSettings = field(default_factory=TrainSettings)
    seed: int = 0


def model_config(layers: str, size: ModelSize, tokenizer) -> dict:
    from kvstate.recall.chat_data import EOS
    from kvstate.recall.init_checkpoint import qwen3_5_config

    return qwen3_5_config(vocab_size=tokenizer.get_vocab_size(), layers=layers, eos_token_id=tokenizer.token_to_id(EOS),
                          pad_token_id=tokenizer.token_to_id("<|endoftext|>"), **asdict(size))


def write_tokenizer(tokenizer, path: Path) -> None:
    from kvstate.recall.chat_data import EOS, tokenizer_config

    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2))
    eos = tokenizer.token_to_id(EOS)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": 0,
                                                             "do_sample": False}, indent=2))


def train_one(layers: str, recipe: DefaultRecipe, out: Path, *,
              on_step: Callable[[int, float, float, int], None] | None = None) -> dict[str, dict[int, float]]:
    """Train one model and save it into `out`; -> {"phonebook": accuracy at each of EVAL_ENTRIES,
    "copy": exact repeats at each of EVAL_COPY_WORDS}. `on_step(step, loss, accuracy, total steps)`
    after each step (the total shrinks when the copy stage ends early)."""
    import torch

    from kvstate.models.loader import load_model
    from kvstate.models.saver import save_checkpoint
    from kvstate.recall.chat_data import build_tokenizer
    from kvstate.recall.init_checkpoint import write_initial_checkpoint
    from kvstate.recall.shipped_training import Trainer, copy_accuracy, phonebook_accuracy

    tokenizer = build_tokenizer()
    cfg = model_config(layers, recipe.size, tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        model, plan = load_model(write_initial_checkpoint(cfg, tmp, seed=recipe.seed))
    torch.manual_seed(recipe.seed)
    trainer = Trainer(model, recipe.train, tokenizer, seed=recipe.seed)
    while not trainer.finished:
        loss, acc = trainer.step()
        if on_step is not None:
            on_step(trainer.done - 1, loss, acc, trainer.total_steps)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, plan, out)
    write_tokenizer(tokenizer, out)
    return {"phonebook": {e: phonebook_accuracy(model, tokenizer, e) for e in EVAL_ENTRIES},
            "copy": {w: copy_accuracy(model, tokenizer, w) for w in EVAL_COPY_WORDS}}


def train_default(out_dir: Path, recipe: DefaultRecipe = DefaultRecipe(), *, names=tuple(LAYERS),
                  on_step: Callable[[str, int, float, float, int], None] | None = None,
                  layers: dict[str, str] | None = None) -> dict[str, dict]:
    """Train each named model into `out_dir/<name>`; -> name -> `train_one`'s accuracies. A name is a
    shipped model's, or one of `layers` (name -> layer string: the same recipe with another mix)."""
    table = {**LAYERS, **(layers or {})}
    results = {}
    for name in names:
        step = None if on_step is None else (lambda i, loss, acc, total, name=name: on_step(name, i, loss, acc, total))
        results[name] = train_one(table[name], recipe, Path(out_dir) / name, on_step=step)
    return results
