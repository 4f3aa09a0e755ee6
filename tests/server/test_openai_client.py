"""The official `openai` client against a live server on loopback: completions and chat, streamed
and not, give the same tokens as `LLM.generate` with the same params (greedy, and seeded sampling);
usage counts; n samples; stop strings; logprobs; /v1/models."""

import pytest

openai = pytest.importorskip("openai")

from kvstate import SamplingParams  # noqa: E402
from tests.server.conftest import MODEL_NAME  # noqa: E402

PROMPT = "the quick brown"


@pytest.fixture(scope="module")
def client(live_server):
    with openai.OpenAI(base_url=live_server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def reference(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(ignore_eos=True, **kw))[0]


def token_ids(llm, text):
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, top_p=0.9, seed=1234)])
def test_completion_matches_llm_generate(client, reference_llm, sampling):
    want = reference(reference_llm, PROMPT, max_tokens=12, **sampling)
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True},
                                    **sampling)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == 12 and got.usage.total_tokens == got.usage.prompt_tokens + 12


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)])
def test_streamed_completion_matches_llm_generate(client, reference_llm, sampling):
    want = reference(reference_llm, [5, 6, 7, 8], max_tokens=10, **sampling)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=10, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}, **sampling))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == 4


def test_chat_matches_llm_chat(client, reference_llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hybrid models"}]
    want = reference_llm.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    got = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.usage.completion_tokens == 10

    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples_and_seeds(client, reference_llm):
    want = reference_llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=99, n=3, max_tokens=8,
                                                         ignore_eos=True))[0]
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=3, seed=99, temperature=1.0, max_tokens=8,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [o.text for o in want.outputs]
    assert got.usage.completion_tokens == 24


def test_several_prompts_are_choice_groups(client, reference_llm):
    prompts = ["the quick brown", "hybrid models"]
    got = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=0)
    want = [reference(reference_llm, p, max_tokens=6, temperature=0).text for p in prompts]
    assert [c.text for c in got.choices] == want


def test_stop_string_is_left_out(client, reference_llm):
    full = reference(reference_llm, PROMPT, max_tokens=24, temperature=0).text
    stop = full[6:10]
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == full[: full.find(stop)] and got.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == full[: full.find(stop)]


def test_logprobs(client, reference_llm):
    want = reference(reference_llm, PROMPT, max_tokens=5, temperature=0, logprobs=3)
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e[0] for e in want.logprobs], abs=1e-5)
    assert len(lp.tokens) == 5 and all(1 <= len(t) <= 3 for t in lp.top_logprobs)  # tokens decoding alike share a key
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 for c in content)


def test_streamed_logprobs_equal_the_engine_s(client, reference_llm):
    want = reference(reference_llm, PROMPT, max_tokens=6, temperature=0, logprobs=2)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs is not None]
    streamed = [x for p in parts for x in p.token_logprobs]
    assert streamed == pytest.approx([e[0] for e in want.logprobs], abs=1e-5)
    offsets = [x for p in parts for x in p.text_offset]
    assert offsets == sorted(offsets) and offsets[0] == 0
    chat = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                               stream=True))
    content = [x for c in chat if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert len(content) == 4 and all(len(x.top_logprobs) == 2 and x.logprob <= 0 for x in content)


def test_models_lists_the_served_model(client, live_server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].max_model_len == live_server.loop.core.max_model_len


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
