"""The user API over the engine core: per-request routing of outputs (interleaved streams), streamed
text that holds back a stop string, one bad request failing alone, params as dicts, checked
max_model_len and stop_token_ids, n samples per prompt, penalties against transformers, chat.

A tiny random Qwen3.5 checkpoint with a tiny trained BPE tokenizer (300 tokens), as the CLI tests use.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from kvstate import LLM, KvstateError, SamplingParams
from tests.engine.test_engine import tiny_qwen3_5
from tests.models.test_tokenizer import write_tokenizer

VOCAB = 300


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("api")
    hf = tiny_qwen3_5(vocab=VOCAB)
    hf.save_pretrained(path)
    write_tokenizer(path)
    return path, hf


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint[0], cache_memory="16MiB")


def greedy(n=8, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def drain(streams, limit=2000):
    """Advance several stream iterators in turn, one event at a time; returns {stream: [events]}."""
    events = {i: [] for i in range(len(streams))}
    live = dict(enumerate(streams))
    for _ in range(limit):
        if not live:
            return events
        for i, it in list(live.items()):
            ev = next(it, None)
            if ev is None:
                del live[i]
            else:
                events[i].append(ev)
    raise AssertionError(f"streams {sorted(live)} did not end")


def test_interleaved_streams_both_complete(llm):
    """Each step's outputs reach the stream of their request, whoever called step()."""
    a = llm.stream([[5, 6, 7], [8, 9]], greedy(3))
    b = llm.stream([[10, 11, 12, 13]], greedy(6))
    events = drain([a, b])
    finals_a = [e.output for e in events[0] if e.finished]
    finals_b = [e.output for e in events[1] if e.finished]
    assert [len(o.token_ids) for o in finals_a] == [3, 3] and [len(o.token_ids) for o in finals_b] == [6]
    assert [e.token_id for e in events[1] if not e.finished] == finals_b[0].token_ids
    assert finals_b[0].token_ids == llm.generate([[10, 11, 12, 13]], greedy(6))[0].token_ids


def test_stream_never_shows_the_stop_string(llm):
    prompt = "the quick brown"
    full = llm.generate(prompt, greedy(24))[0].text
    assert len(full) > 12
    stop = full[6:10]  # a stop string met in the middle of the output
    cut = full[: full.find(stop)]
    shown, final = "", None
    for ev in llm.stream(prompt, greedy(24, stop=stop)):
        shown += ev.text
        assert stop not in shown
        if ev.finished:
            final = ev.output
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert shown == final.text == cut


def test_streamed_text_is_the_final_text(llm):
    for prompt in ("hybrid models", "unseen wörds ✓"):
        shown, finals = "", []
        for ev in llm.stream(prompt, greedy(20)):
            shown += ev.text
            if ev.finished:
                finals.append(ev.output)
        assert len(finals) == 1, finals  # the stream ends with exactly one finished event
        assert shown == finals[0].text == llm.tokenizer.decode(finals[0].token_ids)


def test_one_bad_prompt_fails_alone(llm):
    outs = llm.generate([None, "ok", 3.5, [1, 2]], greedy(4))
    assert [o.finish_reason for o in outs] == ["error", "length", "error", "length"]
    assert "prompt" in outs[0].error and "None" in outs[0].error and "float" in outs[2].error
    assert outs[1].token_ids == llm.generate("ok", greedy(4))[0].token_ids


def test_params_as_dicts(llm):
    want = llm.generate([[1, 2, 3]], greedy(5))[0].token_ids
    assert llm.generate([[1, 2, 3]], {"temperature": 0, "max_tokens": 5, "ignore_eos": True})[0].token_ids == want
    outs = llm.generate([[1, 2, 3], [1, 2, 3]], [{"temperature": 0, "max_tokens": 5, "ignore_eos": True},
                                                {"max_tokens": 0}])
    assert outs[0].token_ids == want
    assert outs[1].finish_reason == "error" and "max_tokens must be >= 1" in outs[1].error
    bad = llm.generate([[1, 2]], {"temprature": 0})[0]
    assert bad.finish_reason == "error" and "temprature" in bad.error


def test_stop_token_ids_outside_the_vocabulary_fail_that_request(llm):
    outs = llm.generate([[1, 2], [3, 4]], [greedy(3, stop_token_ids=[VOCAB + 5]), greedy(3)])
    assert outs[0].finish_reason == "error" and str(VOCAB + 5) in outs[0].error and "vocabulary" in outs[0].error
    assert outs[1].finish_reason == "length"


@pytest.mark.parametrize("value, message", [
    (-4, "max_model_len must be >= 1, got -4"),
    (0, "max_model_len must be >= 1, got 0"),
    (10**6, "max_model_len 1000000 is more than the model's maximum"),
    ("64", "max_model_len must be an integer"),
])
def test_max_model_len_is_checked(checkpoint, value, message):
    with pytest.raises(KvstateError, match=message) as e:
        LLM(checkpoint[0], cache_memory="16MiB", max_model_len=value)
    assert "\n" not in str(e.value)


def test_max_model_len_is_used(checkpoint):
    llm = LLM(checkpoint[0], cache_memory="16MiB", max_model_len=40)
    assert llm.max_model_len == 40
    out = llm.generate([list(range(1, 36))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_repetition_penalty_matches_transformers_generate(checkpoint, llm):
    _, hf = checkpoint
    prompt = [3, 3, 7, 9, 3, 12, 7]
    for penalty in (1.3, 0.7):
        got = llm.generate([prompt], greedy(12, repetition_penalty=penalty))[0].token_ids
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=12, min_new_tokens=12, do_sample=False, repetition_penalty=penalty,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == ref
    assert got != llm.generate([prompt], greedy(12))[0].token_ids  # the penalty changed something


def test_presence_and_frequency_penalties_steer_greedy_decoding(llm):
    prompt = [4, 4, 4, 4]
    plain = llm.generate([prompt], greedy(16))[0].token_ids
    assert len(set(plain)) < 16  # the tiny model repeats itself
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        out = llm.generate([prompt], greedy(16, **kw))[0].token_ids
        assert out != plain and len(set(out)) > len(set(plain))


def test_n_samples_per_prompt(llm):
    p = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=6, ignore_eos=True)
    out = llm.generate([[1, 2, 3]], p)[0]
    assert len(out.outputs) == 3 and [c.index for c in out.outputs] == [0, 1, 2]
    assert out.token_ids == out.outputs[0].token_ids and out.text == out.outputs[0].text
    for k, c in enumerate(out.outputs):  # sample k is the request with seed + k (vLLM's rule)
        alone = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, seed=11 + k, max_tokens=6, ignore_eos=True))
        assert c.token_ids == alone[0].token_ids and c.finish_reason == "length"
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    finals = [e for e in llm.stream([[1, 2, 3], [4]], p) if e.finished]
    assert [len(e.output.outputs) for e in finals] == [3, 3]


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "user", "content": "hybrid models"}]
    got = llm.chat(messages, greedy(5))[0]
    text = llm.tokenizer.apply_chat_template(messages)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert got.prompt_token_ids == ids
    assert got.token_ids == llm.generate([ids], greedy(5))[0].token_ids
    two = llm.chat([messages, [{"role": "user", "content": "the quick brown"}]], greedy(5))
    assert len(two) == 2 and two[0].token_ids == got.token_ids


def test_engine_core_reports_each_request_once_and_a_duplicate_id_alone(llm):
    core = llm.engine
    core.add_request("x", [1, 2, 3], greedy(4))
    core.add_request("x", [4, 5], greedy(4))  # the id is in use: this one is rejected, "x" runs on
    seen, finals = [], []
    while core.has_unfinished():
        for out in core.step():
            assert out.request_id == "x"
            seen += out.token_ids
            if out.finished:
                finals.append(out.output)
    assert [o.finish_reason for o in finals] == ["error", "length"] and "already in use" in finals[0].error
    assert seen == finals[1].token_ids == llm.generate([[1, 2, 3]], greedy(4))[0].token_ids
    assert core.stats()["num_running"] == 0 and core.stats()["kv_blocks_used"] == 0


def test_llm_takes_a_hub_id(checkpoint, llm, tmp_path, monkeypatch):
    """A hub id resolves (offline, through huggingface_hub's cache) to the checkpoint and its tokenizer."""
    from huggingface_hub import constants

    from tests.hub_cache import populate_from_dir

    populate_from_dir(tmp_path / "hub", "org/api-tiny", checkpoint[0])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub = LLM("org/api-tiny", cache_memory="16MiB")
    assert hub.tokenizer is not None
    assert hub.generate("the quick brown", greedy(5))[0].text == llm.generate("the quick brown", greedy(5))[0].text


def test_closing_a_stream_aborts_its_requests_only(llm):
    mine = llm.stream([[1, 2, 3], [4, 5]], greedy(40))
    other = llm.stream([[6, 7, 8]], greedy(5))
    next(mine), next(other), next(mine)
    mine.close()  # the caller went away: its two requests are aborted, the other one runs on
    finals = [e.output for e in other if e.finished]
    assert [o.finish_reason for o in finals] == ["length"] and len(finals[0].token_ids) == 5
    assert not llm.engine.has_unfinished()
    stats = llm.engine.stats()
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0
