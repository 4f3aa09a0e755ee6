"""What the engine hands out, with vLLM's field names (no torch).

- `EngineOutput`: what `EngineCore.step()` returns for each request that changed in the step
  (the new tokens, the new text, and when it finished, its whole `RequestOutput`).
- `RequestOutput`: one prompt's result; `outputs` holds its n samples (`CompletionOutput`),
  and `text`, `token_ids`, `finish_reason`, ... are those of the first (what one-sample callers read).
- `StreamEvent`: what `LLM.stream` yields: one new token of one sample, or a prompt's end.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's Logprob): rank 1 = the most likely."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# per prompt position: None for the first token, then {token id: Logprob}, the prompt's own token first
PromptLogprobs = list  # list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int  # which of the n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list | None = None  # per token: (logprob of the chosen token, [(token, logprob) top-n])


@dataclass
class RequestOutput:
    request_id: object
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    error: str | None = None  # why the request failed (finish_reason "error")
    metrics: dict = field(default_factory=dict)  # time_to_first_token, time_per_output_token, latency, ...
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (vLLM's name)
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs (PromptLogprobs)
    cache_report: object = None  # kvstate.engine.cache_report.CacheReport: what the cache reused, why it stopped

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list | None:
        return self.outputs[0].logprobs

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @classmethod
    def failed(cls, request_id, prompt, error: str, prompt_token_ids: list[int] | None = None) -> "RequestOutput":
        """A request that never ran: finish_reason "error" and why."""
        return cls(request_id, prompt if isinstance(prompt, str) else None, list(prompt_token_ids or []),
                   [CompletionOutput(0, "", [], "error")], error=error)


@dataclass
class EngineOutput:
    """One request's news from one engine step."""

    request_id: object
    token_ids: list[int]  # tokens sampled this step (empty when only finishing or rejected)
    text: str  # text those tokens add, less what could still turn out to be a stop string
    finished: bool
    output: RequestOutput | None = None  # the whole request, when finished
    logprobs: list | None = None  # per token of token_ids, as RequestOutput.logprobs (when asked for)
    # the request's first news only, with SamplingParams.prompt_logprobs: RequestOutput.prompt_logprobs
    # (a stream that echoes the prompt sends them first)
    prompt_logprobs: list | None = None


@dataclass
class StreamEvent:
    """One new token of one request, as `LLM.stream` yields them."""

    index: int  # position of the request in the prompts given
    token_id: int | None  # None on the closing event (and on text released without a token)
    text: str  # the text this token adds (may be "" while a character or a possible stop string is incomplete)
    finished: bool  # the closing event: `output` holds the whole request
    output: RequestOutput | None = None
    sample: int = 0  # which of the request's n samples


def merge_metrics(parts: list[dict]) -> dict:
    """One request's metrics from those of its n samples (first token: earliest; latency: latest)."""
    if len(parts) == 1:
        return dict(parts[0])

    def pick(key, fn):
        values = [p[key] for p in parts if p.get(key) is not None]
        return fn(values) if values else None

    return {"time_to_first_token": pick("time_to_first_token", min),
            "time_per_output_token": pick("time_per_output_token", lambda v: sum(v) / len(v)),
            "latency": pick("latency", max),
            "num_prompt_tokens": pick("num_prompt_tokens", max),
            "num_output_tokens": pick("num_output_tokens", sum),
            "num_preemptions": pick("num_preemptions", sum)}
