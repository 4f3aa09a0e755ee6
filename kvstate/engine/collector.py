"""One prompt's outputs as the engine core delivers them: the per-request queue of the user API.

`EngineCore.step()` returns the news of every request, whoever called it; `LLM`'s router
(kvstate.engine.router) puts each `EngineOutput` into the collector of its prompt, so any
number of `stream()` iterators can drive the engine in turn and each still sees all of its own
events.
A prompt with n samples is n engine requests gathered here into one `RequestOutput`.
"""

from __future__ import annotations

from collections import deque

from kvstate.engine.cache_report import merge_reports
from kvstate.engine.outputs import CompletionOutput, EngineOutput, RequestOutput, StreamEvent, merge_metrics


class RequestCollector:
    def __init__(self, index: int, request_id, prompt: str | None, prompt_token_ids: list[int], n: int = 1):
        self.index = index  # position of the prompt in the call that made it
        self.request_id = request_id
        self.prompt, self.prompt_token_ids, self.n = prompt, prompt_token_ids, n
        self.events: deque[StreamEvent] = deque()  # not yet handed to the caller
        self.output: RequestOutput | None = None  # set when all n samples are finished
        self._done: dict[int, RequestOutput] = {}  # sample -> its final output

    @classmethod
    def failed(cls, index: int, request_id, prompt, error: str) -> "RequestCollector":
        """A prompt that never reached the engine (bad input): finished at once with its error."""
        c = cls(index, request_id, prompt if isinstance(prompt, str) else None, [])
        c.output = RequestOutput.failed(request_id, prompt, error)
        return c

    @property
    def done(self) -> bool:
        return self.output is not None

    def put(self, sample: int, out: EngineOutput) -> None:
        """One engine output of sample `sample`: its tokens become events (the text on the last)."""
        for j, token in enumerate(out.token_ids):
            text = out.text if j == len(out.token_ids) - 1 else ""
            self.events.append(StreamEvent(self.index, token, text, False, sample=sample))
        if not out.token_ids and out.text:  # text released without a token (a request ended early)
            self.events.append(StreamEvent(self.index, None, out.text, False, sample=sample))
        if out.finished:
            self._done[sample] = out.output
            if len(self._done) == self.n:
                self.output = self._merge()

    def _merge(self) -> RequestOutput:
        parts = [self._done[k] for k in range(self.n)]
        outputs = [CompletionOutput(k, p.text, p.token_ids, p.finish_reason, p.stop_reason, p.logprobs)
                   for k, p in enumerate(parts)]
        error = next((p.error for p in parts if p.error), None)
        ids = parts[0].prompt_token_ids or self.prompt_token_ids
        cached = [p.num_cached_tokens for p in parts if p.num_cached_tokens is not None]
        return RequestOutput(self.request_id, self.prompt, list(ids), outputs, error=error,
                             metrics=merge_metrics([p.metrics for p in parts]),
                             num_cached_tokens=min(cached) if cached else None,
                             prompt_logprobs=parts[0].prompt_logprobs,
                             cache_report=merge_reports([p.cache_report for p in parts]))
