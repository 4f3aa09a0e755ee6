"""What `LLM.generate` returns per request, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: object
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    logprobs: list | None = None  # per token: (logprob of the chosen token, [(token, logprob) top-n])
    metrics: dict = field(default_factory=dict)  # time_to_first_token, time_per_output_token, latency, ...

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamEvent:
    """One new token of one request, as `LLM.stream` yields them."""

    index: int  # position of the request in the prompts given
    token_id: int | None  # None on the closing event of a request
    text: str  # the text this token adds (may be "" while a multi-byte character is incomplete)
    finished: bool  # the closing event: `output` holds the whole request
    output: RequestOutput | None = None
