"""The shipped models' training pieces on tiny sizes: tokenizer and chat data, the initial checkpoint
(transformers' names and shapes), the trainer (loss drops, exact-answer scoring equals greedy), and
train-default end to end on a few steps (a checkpoint transformers loads with the same logits)."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from kvstate.models.generate import forward_logits
from tests.greedy import greedy_generate
from kvstate.models.loader import load_model
from kvstate.models.tokenizer import Tokenizer
from kvstate.recall.chat_data import (EOS, build_tokenizer, copy_chat, encode_chat, phonebook_chat, render,
                                      tokenizer_config)
from kvstate.recall.init_checkpoint import qwen3_5_config, write_initial_checkpoint
from kvstate.recall.shipped_training import (Trainer, TrainSettings, first_answer_exact, packed_forward,
                                             targets_of)
from kvstate.recall.train_default import DefaultRecipe, ModelSize, train_default, write_tokenizer

TINY = ModelSize(hidden_size=32, intermediate_size=48, heads=2, kv_heads=1, head_dim=16, linear_heads=2,
                 linear_head_dim=16)
FAST = TrainSettings(steps=3, batch=4, max_entries=4, turns=2, copy_words=(4, 8), warmup=1, copy_first=2,
                     copy_long=1)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def tiny_model(tmp_path, tok, layers="GA", seed=0, tied=True):
    from dataclasses import asdict

    size = asdict(TINY) | {"tie_word_embeddings": tied}
    cfg = qwen3_5_config(vocab_size=tok.get_vocab_size(), layers=layers, eos_token_id=tok.token_to_id(EOS),
                         pad_token_id=0, **size)
    return load_model(write_initial_checkpoint(cfg, tmp_path / f"init-{layers}-{seed}", seed=seed))


def test_chat_encoding_is_the_rendered_template_and_trains_only_replies(tmp_path, tok):
    rng = np.random.default_rng(0)
    write_tokenizer(tok, tmp_path)
    engine_tok = Tokenizer(tmp_path)  # what the engine reads: tokenizer.json + tokenizer_config.json
    for chat in (phonebook_chat(rng, 6, turns=3), copy_chat(rng, 12)):
        ids, trained = encode_chat(tok, chat)
        assert ids == engine_tok.encode(engine_tok.apply_chat_template(chat.messages, add_generation_prompt=False),
                                        add_special_tokens=False)
        assert ids == tok.encode(render(chat), add_special_tokens=False).ids
        reply_text = engine_tok.decode([i for i, t in zip(ids, trained) if t], skip_special_tokens=False)
        assert reply_text == "".join(a + EOS for a in chat.answers)
        assert tok.token_to_id("<unk>") not in ids
    assert engine_tok.decode(ids) == render(chat).replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert engine_tok.eos_token_ids == {tok.token_to_id(EOS)}
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == tokenizer_config()


def test_a_name_and_its_number_are_the_same_tokens_in_book_question_and_reply(tok):
    """The lookup key and the answer must be one token wherever they appear: with ' Nadia Khan' in
    the question and 'Nadia Khan' in the book (or ' 86' stored, '86' answered) a model has to learn
    that two random embeddings mean the same thing, name by name, and never finds the lookup."""
    chat = phonebook_chat(np.random.default_rng(0), 6, turns=3)
    pieces = [tok.id_to_token(i) for i in encode_chat(tok, chat)[0]]
    for reply in chat.answers:
        name, number = reply.split(": ")
        assert pieces.count(name) >= 3  # the book's line, the question, the reply
        for pair in (number[:2], number[2:]):
            assert pieces.count(pair) >= 2 and " " + pair not in pieces
    assert not any(p.startswith(" ") and p.strip() in (n for n, _ in [a.split(": ") for a in chat.answers])
                   for p in pieces)


@pytest.mark.parametrize("tied", [True, False])
def test_initial_checkpoint_is_transformers_qwen3_5(tmp_path, tok, tied):
    from transformers import AutoModelForCausalLM

    model, plan = tiny_model(tmp_path, tok, "GGGA", tied=tied)
    assert plan.model_type == "qwen3_5_text" and plan.layer_string == "GGGA" and plan.tie_word_embeddings == tied
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "init-GGGA-0").eval()  # strict names and shapes
    ids = [tok.token_to_id(t) for t in ("Alice Smith", ":", " ", "12", "34", "\n", "What", " is")] * 3
    assert None not in ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = forward_logits(model, [ids])[0]
    assert float((ours - ref).norm() / ref.norm()) < 1e-4


def test_exact_answer_scoring_equals_greedy_decoding(tmp_path, tok):
    model, _ = tiny_model(tmp_path, tok, "GA", seed=3)
    rng = np.random.default_rng(1)
    encoded = [encode_chat(tok, phonebook_chat(rng, 3, turns=2, digits=1)) for _ in range(6)]
    targets, owner = targets_of(encoded)
    rows = (targets != -100).nonzero().flatten()
    with torch.no_grad():
        exact = first_answer_exact(packed_forward(model, [i for i, _ in encoded], rows), targets, owner, 6)
    for k, (ids, trained) in enumerate(encoded):
        start = trained.index(True)
        end = start + trained[start:].index(False)  # first reply and its end marker
        out = greedy_generate(model, ids[:start], end - start)
        assert bool(exact[k]) == (out == ids[start:end]), k


def test_training_loss_drops(tmp_path, tok):
    torch.manual_seed(0)
    model, _ = tiny_model(tmp_path, tok, "GA")
    settings = TrainSettings(steps=40, batch=8, max_entries=3, turns=3, copy_share=0.0, copy_first=0, copy_long=0,
                             warmup=5)
    trainer = Trainer(model, settings, tok, seed=0)
    losses = [trainer.step()[0] for _ in range(40)]
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3]), losses


def test_curriculum_grows_the_book_only_once_the_model_answers():
    from kvstate.recall.shipped_training import Curriculum

    c = Curriculum(TrainSettings(start_entries=2, max_entries=7, grow_at=0.6))
    for _ in range(200):
        c.update(0.5)  # below the bar: never grows
        c.update(float("nan"))  # a batch without a phone book changes nothing
    assert c.top == 2
    sizes = []
    for _ in range(400):
        c.update(1.0)
        sizes.append(c.top)
    assert sorted(set(sizes)) == [2, 3, 4, 6, 7] and sizes == sorted(sizes)  # 1.5x (at least +1), capped
    fresh = Curriculum(TrainSettings(start_entries=2, max_entries=7, grow_at=0.6))
    steps = 0
    while fresh.top == 2:
        fresh.update(1.0)
        steps += 1
    assert 10 <= steps <= 30  # a running average over about 20 steps, not one lucky batch


def test_copy_stage_samples_short_copy_chats_until_the_model_repeats_them():
    from kvstate.recall.shipped_training import Curriculum, sample_chats

    s = TrainSettings(copy_first=100, copy_until=0.6, first_copy_words=(2, 5), copy_share=0.25, copy_words=(30, 40),
                      max_entries=4)
    rng = np.random.default_rng(0)
    chats = sample_chats(rng, s, 64, 4, copy_stage=True)
    assert {c.kind for c in chats} == {"copy"} and all(2 <= len(c.answers[0].split()) <= 5 for c in chats)
    long = sample_chats(rng, s, 64, 4, copy_stage=True, long_copies=True)
    assert {c.kind for c in long} == {"copy"} and all(30 <= len(c.answers[0].split()) <= 40 for c in long)
    later = sample_chats(rng, s, 400, 4)
    copies = [c for c in later if c.kind == "copy"]
    assert 0.15 < len(copies) / len(later) < 0.35 and any(c.kind == "phonebook" for c in later)
    assert all(30 <= len(c.answers[0].split()) <= 40 for c in copies)

    c = Curriculum(s)
    for step in range(50):
        assert c.copy_stage(step)
        c.update(float("nan"), 0.0)  # no passage repeated yet: the stage goes on
    steps = 0
    while c.copy_stage(50 + steps):
        c.update(float("nan"), 1.0)
        steps += 1
    assert 10 <= steps <= 30 and c.top == 2  # a running rate over about 20 steps; books untouched
    capped = Curriculum(s)
    assert capped.copy_stage(99) and not capped.copy_stage(100)  # at most copy_first steps
    assert not Curriculum(TrainSettings(copy_first=0)).copy_stage(0)  # no copy stage


def test_copy_stage_then_a_fixed_number_of_steps_on_their_own_lr_schedule(tmp_path, tok, monkeypatch):
    """The copy stage runs at copy_lr: short passages until the model repeats them (at most
    copy_first steps), then copy_long steps of long ones; then exactly `steps` more on a cosine from
    lr to lr / 10, whenever the stage ended."""
    import math

    model, _ = tiny_model(tmp_path, tok, "GA")
    s = TrainSettings(steps=4, copy_first=50, copy_long=2, batch=2, max_entries=3, turns=1, warmup=2, lr=1e-3,
                      copy_lr=4e-3, first_copy_words=(2, 3), copy_words=(20, 21))
    trainer = Trainer(model, s, tok, seed=0)
    assert trainer.total_steps == 56 and not trainer.finished
    lrs = []
    for _ in range(3):
        trainer.step()
        lrs.append(trainer.opt.param_groups[0]["lr"])
    assert lrs == [2e-3, 4e-3, 4e-3]  # warm-up, then constant
    trainer.curriculum.copied = True  # as if the running repeat rate had passed copy_until
    assert trainer.total_steps == 3 + 2 + 4 and trainer.in_copy_stage()
    from kvstate.recall import shipped_training

    seen, sample = [], shipped_training.sample_chats
    monkeypatch.setattr(shipped_training, "sample_chats", lambda *a, **k: seen.append(k) or sample(*a, **k))
    while not trainer.finished:
        trainer.step()
        lrs.append(trainer.opt.param_groups[0]["lr"])
    assert [k["copy_stage"] for k in seen] == [True, True, False, False, False, False]
    assert all(k["long_copies"] for k in seen[:2])
    assert trainer.done == 9 and (trainer.short_end, trainer.copy_end) == (3, 5)
    cosine = [1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi * i / 4))) for i in range(4)]
    assert lrs[3:] == pytest.approx([4e-3, 4e-3] + cosine)
    never = Trainer(model, TrainSettings(steps=2, copy_first=3, copy_long=1, batch=2, max_entries=2, turns=1), tok,
                    seed=0)
    while not never.finished:
        never.step()
    assert never.done == 6 and never.copy_end == 4  # a stage that never ends is cut at copy_first
    none = Trainer(model, TrainSettings(steps=2, copy_first=0, copy_long=0), tok, seed=0)
    assert none.total_steps == 2 and not none.in_copy_stage()


def test_train_default_writes_repeatable_checkpoints_transformers_loads(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = DefaultRecipe(size=TINY, train=FAST, seed=1)
    acc = train_default(tmp_path / "a", recipe, names=("kvstate-phonebook-linear",))
    assert set(acc["kvstate-phonebook-linear"]["phonebook"]) == {1, 2, 4, 8, 16, 32, 64}
    assert set(acc["kvstate-phonebook-linear"]["copy"]) == {4, 16, 64}
    train_default(tmp_path / "b", recipe, names=("kvstate-phonebook-linear",))
    a, b = (load_file(tmp_path / d / "kvstate-phonebook-linear" / "model.safetensors") for d in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # seeded: the same weights

    path = tmp_path / "a" / "kvstate-phonebook-linear"
    model, plan = load_model(path)
    assert plan.layer_string == "GGGG"
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    hf_tok = AutoTokenizer.from_pretrained(path)
    text = hf_tok.apply_chat_template([{"role": "user", "content": "Alice Smith: 1234\nWhat is Alice Smith's number?"}],
                                      tokenize=False, add_generation_prompt=True)
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    assert ids == Tokenizer(path).encode(text, add_special_tokens=False)
    with torch.no_grad():  # no cache: transformers' cache needs an attention layer to count its length
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0]
    assert float((forward_logits(model, [ids])[0] - ref).norm() / ref.norm()) < 1e-4


def test_train_default_cli_reports_phonebook_and_copy_accuracy(tmp_path):
    """The command's JSON and tables: exact answers by book size and exact repeats by passage length."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kvstate", "recall", "train-default", "--steps", "2", "--copy-steps", "1",
           "--only", "linear", "--out", str(tmp_path)]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=True).stdout
    result = json.loads(out)["kvstate-phonebook-linear"]
    assert set(result["phonebook"]) == {"1", "2", "4", "8", "16", "32", "64"}
    assert set(result["copy"]) == {"4", "16", "64"}
    assert all(0.0 <= a <= 1.0 for part in result.values() for a in part.values())
    assert (tmp_path / "kvstate-phonebook-linear" / "model.safetensors").is_file()

    from rich.console import Console

    from kvstate.recall.cli_train_default import _table

    console = Console(record=True, width=200)
    _table(console, {"m": {"phonebook": {4: 0.5, 64: 0.25}, "copy": {16: 1.0, 64: 0.75}}}, tmp_path)
    text = console.export_text()
    assert "phonebook accuracy (exact answer)" in text and "copy accuracy (exact repeat)" in text  # (titles wrap)
    assert "4 entries" in text and "64 words" in text and "75%" in text and "25%" in text


def test_train_default_trains_another_layer_mix_with_the_same_recipe(tmp_path):
    """`--layers AG`: one model of that mix into <out>/phonebook-AG; a bad string or no --out is one line."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "kvstate", "recall", "train-default", "--steps", "1", "--copy-steps", "1"]
    out = subprocess.run([*base, "--layers", "AG", "--out", str(tmp_path), "--json"], capture_output=True, text=True,
                         check=True).stdout
    assert list(json.loads(out)) == ["phonebook-AG"]
    _, plan = load_model(tmp_path / "phonebook-AG")
    assert plan.layer_string == "AG"
    for bad in (["--layers", "AXG", "--out", str(tmp_path)], ["--layers", "AA"]):
        run = subprocess.run([*base, *bad], capture_output=True, text=True)
        assert run.returncode != 0 and "Traceback" not in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1 and "--layers" in run.stderr, run.stderr
