"""Request bodies of the OpenAI endpoints (pydantic), and their translation to SamplingParams.

Field names, types and defaults are OpenAI's; vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids; prompt_logprobs on completions) are accepted as vLLM
does. An unknown field is a 400 naming it (a field the server does not know would otherwise be
silently dropped, e.g. prompt_logprobs on chat); OpenAI's fields that do not change the answer
(`user`, `metadata`, `store`, ...) are accepted, and the ones that would and that kvstate does not
do (tools, function calls, a response_format other than text, audio) are a 400 naming the field.
Bounds that protect the server (n, logprobs) are in the schema, so the OpenAPI document states them
and a bad value is a 400 before any work. Validation itself is bounded too, since it holds the
interpreter even on a worker thread (`kvstate.server.body`): lists stop at their first bad item
(pydantic's `fail_fast`; 1.5M bad token ids made 1.5M error objects, a minute), a prompt is
validated only as the form its first item shows (a union tries every form over the whole list),
lists of prompts and other lists a reply cannot need are counted before their items are read,
and logit_bias (refused when set) is not validated item by item.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from kvstate.engine.params import FLOAT32_TINY, MAX_STOP_TOKEN_IDS, SamplingParams
from kvstate.errors import KvstateError
from kvstate.server.protocol import ApiError

MAX_N = 16  # samples per prompt
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs
MAX_MESSAGES = 1024  # chat turns: each costs template work (and a snapshot hint) however short
MAX_CONTENT_PARTS = 4096  # text parts of all messages together: 240k of them took 2 s to validate,
# holding the interpreter even on a worker thread (kvstate.server.body)
MAX_PROMPTS = 4096  # prompts in one request, before the server's --max-sequences-per-request
MAX_LIST = 64  # stop strings, modalities: far more than any reply takes
MAX_ITEMS = 1024  # logit_bias, tools, functions: refused when set, counted before they are read
SEED = Field(None, ge=-(2**63), le=2**63 - 1)  # torch.Generator.manual_seed's range (seed + k for n samples)
FAIL_FAST = Field(fail_fast=True)

TokenIds = Annotated[list[int], FAIL_FAST]


def _at_most(most: int) -> BeforeValidator:
    """A list's (or dict's) length bound checked before its items are (pydantic's max_length validates all 270k
    chat messages first, on the event loop); kept out of the OpenAPI schema, where schemathesis would
    build lists past it to test it."""
    def check(value):
        if isinstance(value, (list, dict)) and len(value) > most:
            raise ValueError(f"takes at most {most} items, got {len(value)}")
        return value
    return BeforeValidator(check)


def _parts_at_most(most: int) -> BeforeValidator:
    """The text parts of all messages together bounded, counted before any of them is validated (after
    the message count: Annotated runs before-validators last first)."""
    def check(value):
        if isinstance(value, list):
            parts = sum(len(m["content"]) for m in value if isinstance(m, dict) and isinstance(m.get("content"), list))
            if parts > most:
                raise ValueError(f"takes at most {most} content parts in all, got {parts}")
        return value
    return BeforeValidator(check)


def _prompt_form(value) -> str:
    """The form of a prompt, read from its first item: only that form validates it."""
    if isinstance(value, str):
        return "text"
    first = value[0] if isinstance(value, list) and value else None
    return "texts" if isinstance(first, str) else "batch" if isinstance(first, list) else "ids"


Prompt = Annotated[Union[
    Annotated[str, Tag("text")],
    Annotated[list[str], FAIL_FAST, _at_most(MAX_PROMPTS), Tag("texts")],
    Annotated[TokenIds, Tag("ids")],
    Annotated[list[TokenIds], FAIL_FAST, _at_most(MAX_PROMPTS), Tag("batch")],
], Discriminator(_prompt_form)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """The sampling fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="the served model's name (GET /v1/models); omitted: that model")
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, ge=FLOAT32_TINY, le=1)  # below: 0 in float32, every token masked
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, Annotated[list[str], FAIL_FAST, _at_most(MAX_LIST)], None] = Field(
        None, description="up to 4 strings that end the output (left out)")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = SEED
    logit_bias: Annotated[dict[str, Any] | None, _at_most(MAX_ITEMS)] = Field(
        None, description="not supported: a 400 when set")
    user: str | None = None
    # OpenAI's bookkeeping fields: accepted, no effect on the answer
    metadata: Annotated[dict[str, Any] | None, _at_most(16)] = None  # OpenAI's bound
    store: bool | None = None
    service_tier: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=FLOAT32_TINY, le=100)
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[int] | None, FAIL_FAST, _at_most(MAX_STOP_TOKEN_IDS)] = None
    # kvstate's extra: with prefix caching, keep the state after this many prompt tokens (or after this
    # text, which the prompt must start with; or a list of either), so later requests sharing it resume there
    cache_prefix: Union[int, str, list[Union[int, str]], None] = None
    # vLLM's field: with prefix caching, cached blocks and snapshots are shared only between requests
    # with the same salt (docs/serving.md: the multi-tenant answer to the timing side channel)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """One sample's params (n = 1: the route fans the n samples out with for_sample)."""
        if self.logit_bias:
            raise ApiError("logit_bias is not supported", param="logit_bias")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and len(stop) > 4:
            raise ApiError(f"stop takes at most 4 strings, got {len(stop)}", param="stop")
        fields = dict(temperature=1.0 if self.temperature is None else self.temperature,
                      top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                      min_p=self.min_p or 0.0, seed=self.seed, stop=[s for s in stop or [] if s] or None,
                      stop_token_ids=self.stop_token_ids, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                      logprobs=logprobs, prompt_logprobs=prompt_logprobs, n=self.n,
                      presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                      repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty)
        try:
            return SamplingParams(**fields)
        except KvstateError as exc:  # "SamplingParams.top_p must be ..." -> param top_p
            message = str(exc)
            param = message.split(".", 1)[1].split(" ", 1)[0] if message.startswith("SamplingParams.") else None
            raise ApiError(message.removeprefix("SamplingParams."), param=param) from None


def lone_surrogate(text: str) -> bool:
    """Whether `text` holds a lone surrogate ("\ud800" in JSON): not text a tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class CompletionRequest(_Sampling):
    prompt: Prompt = Field(
        ..., description="a text, token ids, or a list of either (one choice group per prompt)")
    max_tokens: int | None = Field(16, ge=0, description="0: the prompt only (with echo or prompt_logprobs)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="vLLM's: per prompt token")

    def scored_prompt(self) -> int | None:
        """The engine's prompt_logprobs: echo with logprobs scores the prompt (the legacy logprobs
        object covers it), as does max_tokens 0, whose reply is the prompt only. A stream with echo
        sends the prompt (and its logprobs) in each choice's first chunk, as vLLM; vLLM's own
        prompt_logprobs field is not streamed."""
        if self.prompt_logprobs is not None and self.stream:
            raise ApiError("prompt_logprobs with stream is not supported: ask for the whole reply",
                           param="prompt_logprobs")
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise ApiError("max_tokens 0 returns nothing without echo or prompt_logprobs", param="max_tokens")
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else 0 if self.max_tokens == 0 else None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: Annotated[list[Any] | None, _at_most(MAX_ITEMS)] = Field(
        None, description="not supported: a 400")
    function_call: Any = Field(None, description="not supported: a 400")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], _parts_at_most(MAX_CONTENT_PARTS), _at_most(MAX_MESSAGES)] = Field(
        ..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM's extra
    parallel_tool_calls: bool | None = None  # no tools: accepted, no effect
    reasoning_effort: str | None = None
    # OpenAI fields kvstate does not do: refused by name (`unsupported`) rather than ignored
    tools: Annotated[list[Any] | None, _at_most(MAX_ITEMS)] = Field(None, description="not supported: a 400")
    tool_choice: Any = Field(None, description="not supported (only \"none\"): a 400")
    functions: Annotated[list[Any] | None, _at_most(MAX_ITEMS)] = Field(None, description="not supported: a 400")
    function_call: Any = Field(None, description="not supported: a 400")
    response_format: Annotated[dict[str, Any] | None, _at_most(MAX_ITEMS)] = Field(
        None, description="only {\"type\": \"text\"}")
    audio: Any = Field(None, description="not supported: a 400")
    modalities: Annotated[list[str] | None, FAIL_FAST, _at_most(MAX_LIST)] = Field(
        None, description="only [\"text\"]")
    prediction: Any = Field(None, description="not supported: a 400")

    def unsupported(self) -> str | None:
        """The first field set that kvstate cannot honor (its name), or None."""
        for name in ("tools", "functions", "function_call", "audio", "prediction"):
            if getattr(self, name):
                return name
        if self.tool_choice not in (None, "none"):
            return "tool_choice"
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format"
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities"
        return None
