"""The two shipped models (kvstate/data/models): names resolve everywhere, they load in transformers with
kvstate's logits and greedy tokens, the hybrid answers a phone book through the engine, and
`kvstate recall phonebook` reports the documented keys."""

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

import kvstate
from kvstate.cli import main
from kvstate.config import bundled_names
from kvstate.families import read_plan
from kvstate.errors import KvstateError
from kvstate.hub import resolve_checkpoint, resolve_config
from kvstate.models.generate import forward_logits
from tests.greedy import greedy_generate
from kvstate.models.loader import load_model
from kvstate.models.tokenizer import Tokenizer
from kvstate.recall.tasks import phonebook_entries, phonebook_prompt
from kvstate.shipped import DEFAULT_MODEL, SHIPPED, models_dir

HYBRID, LINEAR = SHIPPED
LAYERS = {HYBRID: "GAGA", LINEAR: "GGGG"}


def book_prompt(path, entries: int, seed: int) -> tuple[list[int], str]:
    """Chat-template token ids of a phone book question, and the expected number."""
    book = phonebook_entries(entries, np.random.default_rng(seed))
    name, number = book[seed % entries]
    tok = Tokenizer(path)
    text = tok.apply_chat_template([{"role": "user", "content": phonebook_prompt(book, name).rstrip()}])
    return tok.encode(text, add_special_tokens=False), number


def test_names_resolve_everywhere():
    for name in SHIPPED:
        path = kvstate.model_path(name)
        assert path == models_dir() / name and (path / "tokenizer.json").is_file()
        assert resolve_checkpoint(name) == path and resolve_config(name) == path / "config.json"
        plan = read_plan(name)
        assert plan.model_type == "qwen3_5_text" and plan.layer_string == LAYERS[name] and plan.name == name
        assert name in bundled_names()  # the memory table and the explorer list them
    assert kvstate.model_path(HYBRID.upper()) == kvstate.model_path(HYBRID)
    with pytest.raises(KvstateError, match="not a shipped model"):
        kvstate.model_path("kvstate-phonebook-nope")
    from kvstate.commands.serve import bundled_model

    assert bundled_model() == kvstate.model_path(DEFAULT_MODEL) == kvstate.model_path(HYBRID)


@pytest.mark.parametrize("name", SHIPPED)
def test_loads_in_transformers_with_equal_logits_and_greedy_tokens(name):
    from transformers import AutoModelForCausalLM

    path = kvstate.model_path(name)
    model, plan = load_model(name)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    ids, _ = book_prompt(path, 6, seed=3)
    with torch.no_grad():  # no cache: transformers' cache needs an attention layer to count its length
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0]
        ours = forward_logits(model, [ids])[0]
        assert float((ours - ref).norm() / ref.norm()) < 1e-4
        theirs = list(ids)
        for _ in range(6):  # transformers' greedy, one full forward per token
            theirs.append(int(hf(torch.tensor([theirs]), use_cache=False).logits[0, -1].argmax()))
    assert greedy_generate(model, ids, 6) == theirs[len(ids):]


def test_hybrid_answers_phone_books_through_the_engine_and_the_linear_one_does_not():
    """Greedy through the engine, 16 fresh 4-entry books each: the hybrid replies with the book's line
    ("Name: 1234", then the end of its turn) for most; copying a random line of the book would get
    a quarter. The linear model (no attention) does not find the line (documented: 0%)."""
    from kvstate.llm import LLM
    from kvstate.engine.params import SamplingParams
    from kvstate.recall.phonebook_eval import phonebook_curve

    acc = {}
    for name in SHIPPED:
        llm = LLM(name)
        try:
            acc[name] = phonebook_curve(llm, [4], queries=16, seed=7)[0]["accuracy"]
            if name == HYBRID:
                book = phonebook_entries(4, np.random.default_rng(0))
                out = llm.chat([{"role": "user", "content": phonebook_prompt(book, book[1][0]).rstrip()}],
                               SamplingParams(temperature=0, max_tokens=8))[0]
                assert out.outputs[0].finish_reason == "stop" and out.text.startswith(book[1][0] + ": "), out.text
        finally:
            llm.close()
    assert acc[HYBRID] >= 0.75 and acc[LINEAR] <= 0.25, acc


@pytest.mark.parametrize("name", SHIPPED)
def test_recall_phonebook_json(capsys, name):
    assert main(["recall", "phonebook", "--model", name, "--entries", "2,6", "--queries", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    from kvstate.cache.spec import cache_spec

    spec = cache_spec(read_plan(name), kv_dtype="float32", state_dtype="float32", conv_dtype="float32")
    assert [list(r) for r in rows] == [["entries", "prompt_tokens", "accuracy", "kv_bytes", "state_bytes"]] * 2
    assert [r["entries"] for r in rows] == [2, 6]
    assert 0 < rows[0]["prompt_tokens"] < rows[1]["prompt_tokens"]
    for r in rows:
        assert r["accuracy"] in (0, 1 / 3, 2 / 3, 1)
        assert r["kv_bytes"] == spec.kv_bytes_per_token * r["prompt_tokens"]
        assert r["state_bytes"] == spec.state_bytes > 0
    assert (rows[0]["kv_bytes"] == 0) == (name == LINEAR)  # no attention layer, no KV cache


def test_recall_phonebook_with_int8_projections_still_recalls(capsys):
    """--weight-dtype int8 (weight-only, per-row scales): the trained hybrid still finds the numbers."""
    argv = ["recall", "phonebook", "--model", HYBRID, "--entries", "4", "--queries", "16", "--seed", "7", "--json"]
    assert main(argv + ["--weight-dtype", "int8"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["accuracy"] >= 0.75


def test_recall_phonebook_bad_input_is_one_line(capsys, tmp_path):
    no_tok = tmp_path / "no-tokenizer"
    shutil.copytree(kvstate.model_path(LINEAR), no_tok)
    (no_tok / "tokenizer.json").unlink()
    for argv in (["--model", str(tmp_path / "missing")], ["--model", str(no_tok)], ["--entries", "0"],
                 ["--digits", "13"], ["--plot", str(tmp_path / "no-such-dir" / "p.png")],
                 ["--plot", str(tmp_path / "p.pdf")]):
        assert main(["recall", "phonebook", *argv]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_memory_lists_both_models(capsys):
    assert main(["memory", "--json"]) == 0
    rows = {o["model"]: o for o in json.loads(capsys.readouterr().out)}
    assert rows[HYBRID]["layers"] == read_plan(HYBRID).mixer_counts and rows[HYBRID]["kv_bytes_per_token"] > 0
    assert rows[LINEAR]["kv_bytes_per_token"] == 0


def test_generate_defaults_to_the_hybrid_and_streams_text(capsys):
    assert main(["generate", "--chat", "Alice Smith: 1234\nWhat is Alice Smith's number?", "--max-tokens", "6",
                 "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    text = rows[0]["text"]
    assert text and "<|im" not in text and "<unk>" not in text  # the word-level tokens detokenize to plain text
    model, _ = load_model(HYBRID)
    chat = Tokenizer(kvstate.model_path(HYBRID))
    prompt = chat.apply_chat_template([{"role": "user", "content": "Alice Smith: 1234\nWhat is Alice Smith's number?"}])
    greedy = greedy_generate(model, chat.encode(prompt, add_special_tokens=False), 6, eos_token_ids=chat.eos_token_ids)
    assert text == chat.decode(greedy)  # the default model is the hybrid
