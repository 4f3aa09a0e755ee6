"""The OpenAI endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health.

A handler checks the request (model name, unsupported fields, the server's limits on prompts x n
and prompt characters, sampling fields, prompt length against the engine's max_model_len: 4xx on
anything wrong, the cheap checks before any tokenizing), tokenizes on a worker thread (chat
templates too: the event loop keeps answering /health), turns it into engine requests (one per
prompt and sample, sample k seeded seed + k as vLLM), hands them to the engine loop, and answers
with the whole result or a stream of server-sent events. A request the engine itself rejects
fails before any byte is sent, so it too is a 400. Leaving a stream early aborts its engine
requests; a stream the server ends (a shutdown, a client that stopped reading) ends with an error
event saying why. Generated tokens are counted by the engine loop (aborted requests' too). A chat's
snapshot hints are its last CHAT_HINTS message ends (each costs a render of the whole chat).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse

from kvstate.engine.request_check import prompt_tokens, stop_tokens_problem
from kvstate.errors import KvstateError
from kvstate.llm import cache_prefix_points
from kvstate.server import protocol as P
from kvstate.server.body import ThreadedBodyRoute
from kvstate.server.protocol import ApiError
from kvstate.server.schemas import ChatCompletionRequest, CompletionRequest, lone_surrogate

router = APIRouter(route_class=ThreadedBodyRoute)
CHAT_HINTS = 4  # snapshot hints at the last few message ends only: each costs a render of the whole chat


@router.get("/health")
async def health(request: Request):
    loop = request.app.state.engine_loop
    if not loop.alive:
        return JSONResponse(P.error_body("the engine loop is not running", "internal_error"), status_code=503)
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: Request):
    loop = request.app.state.engine_loop
    return {"object": "list", "data": [{"id": loop.model_name, "object": "model", "created": P.now(),
                                        "owned_by": "kvstate", "max_model_len": loop.core.max_model_len}]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    loop = request.app.state.engine_loop
    _check_model(loop, body)
    if body.suffix:
        raise ApiError("suffix is not supported", param="suffix")
    if body.best_of not in (None, body.n):
        raise ApiError("best_of other than n is not supported", param="best_of")
    prompts = [body.prompt] if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)) \
        else body.prompt
    if not prompts:
        raise ApiError("prompt is empty", param="prompt")
    _check_fanout(request, len(prompts), body.n)
    most = request.app.state.limits.prompt_chars(loop.core.max_model_len)
    for p in prompts:
        if isinstance(p, str):
            _check_text(p, most, "prompt")
            if loop.llm.tokenizer is None:
                raise ApiError("this model has no tokenizer.json: give the prompt as token ids", param="prompt")
    params = body.sampling_params(body.max_tokens, body.logprobs, body.scored_prompt())
    texts = [p if isinstance(p, str) else None for p in prompts]  # echo repeats a text prompt as given
    prompts = await run_in_threadpool(_token_ids, loop, prompts)
    hints = await run_in_threadpool(lambda: [_cache_prefix(loop, body, p) for p in prompts])
    return await _serve(request, body, prompts, params, chat=False, hints=hints, texts=texts)



@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    loop = request.app.state.engine_loop
    _check_model(loop, body)
    field = body.unsupported()
    if field is not None:
        raise ApiError(f"{field} is not supported by this server", param=field)
    tokenizer = loop.llm.tokenizer
    if tokenizer is None:
        raise ApiError("this model has no tokenizer.json: chat needs its chat template", param="messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError("top_logprobs needs logprobs set to true", param="top_logprobs")
    _check_fanout(request, 1, body.n)
    for i, m in enumerate(body.messages):
        if m.tool_calls or m.function_call:
            raise ApiError(f"messages[{i}]: tool and function calls are not supported", param="messages")
        if m.content is None:
            raise ApiError(f"messages[{i}]: content is required", param="messages")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    _check_text("".join(m["content"] for m in messages), request.app.state.limits.prompt_chars(loop.core.max_model_len),
                "messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None)

    def template() -> tuple[list[int], dict[int, str]]:
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        except KvstateError as exc:
            raise ApiError(str(exc), param="messages") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        hints = {}
        if loop.core.prefix_caching:  # the state is kept where each message ends (as LLM.chat)
            ends = tokenizer.message_ends(messages, ids, add_generation_prompt=body.add_generation_prompt,
                                          last=CHAT_HINTS)
            hints = dict.fromkeys(ends, "chat")
        hints.update(_cache_prefix(loop, body, ids))
        return ids, hints

    ids, hints = await run_in_threadpool(template)
    return await _serve(request, body, [ids], params, chat=True, hints=[hints])


# -- requests in ---------------------------------------------------------------------------------
def _cache_prefix(loop, body, ids: list[int]) -> dict[int, str]:
    try:
        return cache_prefix_points(loop.llm.tokenizer, body.cache_prefix, ids)
    except KvstateError as exc:
        raise ApiError(str(exc), param="cache_prefix") from None


def _check_model(loop, body) -> None:
    if body.model is not None and body.model != loop.model_name:
        raise ApiError(f"The model `{body.model}` does not exist (this server serves `{loop.model_name}`)",
                       status=404, param="model", code="model_not_found")


def _check_fanout(request: Request, num_prompts: int, n: int) -> None:
    """prompts x n within the server's --max-sequences-per-request, before any prompt is read."""
    most, flag = request.app.state.limits.max_sequences, "(kvstate serve --max-sequences-per-request, " \
        "at most half of --max-num-seqs)"
    if num_prompts > most:
        raise ApiError(f"{num_prompts} prompts in one request; this server takes at most {most} {flag}",
                       param="prompt")
    if num_prompts * n > most:
        raise ApiError(f"{num_prompts} prompts x n={n} is {num_prompts * n} sequences; this server takes at most "
                       f"{most} per request {flag}", param="n")


def _check_text(text: str, most: int, param: str) -> None:
    """A prompt's text: at most `most` characters (checked before tokenizing), no lone surrogates."""
    if len(text) > most:
        raise ApiError(f"the {param} has {len(text)} characters; this server takes at most {most} "
                       f"(kvstate serve --max-prompt-chars)", param=param, code="context_length_exceeded")
    if lone_surrogate(text):
        raise ApiError(f"the {param} holds a lone UTF-16 surrogate (such as \\ud800): not valid text", param=param)


def _token_ids(loop, prompts) -> list[list[int]]:
    """Token ids of each prompt (a text or token ids), on a worker thread."""
    return [loop.llm.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]


def _check(loop, body, prompts: list[list[int]], params) -> None:
    limit, vocab = loop.core.max_model_len, loop.core.plan.vocab_size
    for ids in prompts:
        if not ids:
            raise ApiError("prompt is empty", param="prompt")
        want = len(ids) + (params.max_tokens or 0)
        if (len(ids) >= limit and params.max_tokens != 0) or want > limit:  # max_tokens 0: the prompt may fill it
            raise ApiError(f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{want} tokens ({len(ids)} in the prompt, {params.max_tokens or 0} in the completion). "
                           f"Please reduce the length of the prompt or max_tokens.", param="prompt",
                           code="context_length_exceeded")
        problem = prompt_tokens(ids, vocab)[1]
        if problem is not None:
            raise ApiError(problem, param="prompt")
    problem = stop_tokens_problem(params.stop_token_ids, vocab)
    if problem is not None:
        raise ApiError(problem, param="stop_token_ids")


# -- results out ---------------------------------------------------------------------------------
async def _serve(request: Request, body, prompts, params, *, chat: bool, hints: list[dict], texts=None):
    loop, metrics = request.app.state.engine_loop, request.app.state.metrics
    _check(loop, body, prompts, params)
    if body.stop and lone_surrogate("".join([body.stop] if isinstance(body.stop, str) else body.stop)):
        raise ApiError("stop holds a lone UTF-16 surrogate: not valid text", param="stop")
    metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
    sub = loop.submit([(ids, params, h or None, body.cache_salt) for ids, h in zip(prompts, hints)])
    reply = _Reply(loop, chat, body.model or loop.model_name, prompts, params)
    if not chat:
        reply.echo = (texts, body.echo, body.prompt_logprobs is not None)
    try:
        if body.stream:  # wait for the first output: a request the engine rejects is still a 4xx
            first = await _unless_disconnected(request, sub.__anext__())
            _raise_if_failed(first[1])
        else:
            await _unless_disconnected(request, reply.gather(sub))
    except BaseException:
        sub.close()
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _EngineStream(reply.stream(first, sub, include_usage), sub)
    for out in reply.finals:
        _raise_if_failed(out)
    return reply.whole()


async def _unless_disconnected(request: Request, work):
    """Await `work`, unless the client hangs up first (a handler that is not streaming is otherwise
    never told, and would keep its requests running to the end): then a 499 that no one reads."""
    async def hang_up():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
    if not task.done() or task.cancelled():
        raise ApiError("the client closed the connection", status=499, type="client_closed_request")
    return task.result()


def _raise_if_failed(out) -> None:
    output = getattr(out, "output", out)
    if output is None or (output.finish_reason != "error" and not output.error):  # error: ended by the server
        return
    message = output.error or "the request failed"
    if message.startswith("engine step failed"):
        raise ApiError(message, status=500, type="internal_error")
    if message.startswith("the server is shutting down"):
        raise ApiError(message, status=503, type="unavailable")
    raise ApiError(message, param="prompt")


class _EngineStream(StreamingResponse):
    """A stream of server-sent events that aborts its engine requests however it ends (finished,
    the client gone, the handler cancelled)."""

    def __init__(self, content, submission):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.submission = submission

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.submission.close()


class _Reply:
    """Gathers one request's engine outputs into OpenAI's reply (whole, or chunk by chunk)."""

    def __init__(self, loop, chat: bool, model: str, prompts, params):
        self.chat, self.model, self.params = chat, model, params
        self.id = P.new_id("chatcmpl" if chat else "cmpl")
        self.created = P.now()
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.n = params.n
        self.finals = [None] * (len(prompts) * params.n)
        self.offsets = [0] * len(self.finals)  # streamed completions: text_offset of the next token
        tok = loop.llm.tokenizer
        self.decode = (lambda t: tok.decode([t], skip_special_tokens=False)) if tok is not None else str
        self.prompts = prompts
        self.echo = (None, False, False)  # completions: (prompt texts or None each, echo, prompt_logprobs asked)
        self.decode_all = (lambda ids: tok.decode(ids, skip_special_tokens=False)) if tok is not None else \
            (lambda ids: "")

    @property
    def completion_tokens(self) -> int:
        return sum(len(f.token_ids) for f in self.finals if f is not None)

    def usage(self) -> dict:
        """OpenAI's usage; with prefix caching, the cached prompt tokens (each prompt's first sample's)."""
        cached = [f.num_cached_tokens for f in self.finals[::self.n] if f is not None]
        total = None if not cached or None in cached else sum(cached)
        return P.usage(self.prompt_tokens, self.completion_tokens, total)

    async def gather(self, sub) -> None:
        async for choice, out in sub:
            self.take(choice, out)

    def take(self, choice: int, out) -> None:
        if out.finished:
            self.finals[choice] = out.output

    def _logprobs(self, f, prompt=None):
        if self.params.logprobs is None or f.logprobs is None:
            return None
        if self.chat:
            return P.chat_logprobs(f.logprobs, f.token_ids, self.decode)
        return P.completion_logprobs(f.logprobs, f.token_ids, self.decode, prompt=prompt)

    def _completion_choice(self, i: int, f) -> dict:
        """One completions choice; with echo, the prompt (its text as given) before the output."""
        texts, echo, scored = self.echo
        text, prompt = f.text, None
        if echo:
            text = self._prompt_text(i) + f.text
            prompt = (self.prompts[i // self.n], f.prompt_logprobs)
        choice = {"index": i, "text": text, "logprobs": self._logprobs(f, prompt), "finish_reason":
                  P.finish_reason(f.finish_reason), "stop_reason": f.stop_reason}
        if scored:
            choice["prompt_logprobs"] = P.prompt_logprobs(f.prompt_logprobs, self.decode)
        return choice

    def _prompt_text(self, i: int) -> str:
        """Choice i's prompt as echo repeats it: its text as given, or its token ids decoded."""
        given = self.echo[0][i // self.n] if self.echo[0] is not None else None
        return given if given is not None else self.decode_all(self.prompts[i // self.n])

    def whole(self) -> dict:
        choices = []
        for i, f in enumerate(self.finals):
            reason = P.finish_reason(f.finish_reason)
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": f.text},
                                "logprobs": self._logprobs(f), "finish_reason": reason, "stop_reason": f.stop_reason})
            else:
                choices.append(self._completion_choice(i, f))
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage(), **self.cache_extension()}

    def cache_extension(self) -> dict:
        """kvstate's extension beside `usage` (OpenAI clients ignore unknown fields): each prompt's
        cache report (kvstate.engine.cache_report), the first sample's of each prompt."""
        reports = [getattr(f, "cache_report", None) for f in self.finals[::self.n] if f is not None]
        if not reports or None in reports:
            return {}
        return {P.CACHE_FIELD: {"prompts": [r.to_dict() for r in reports]}}

    def _chunk(self, choices: list, usage=None, extra: dict | None = None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        body.update(extra or {})
        return P.sse(body)

    def _piece(self, choice: int, text: str | None, reason=None, first=False, logprobs=None) -> dict:
        if not self.chat:
            return {"index": choice, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return {"index": choice, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def _step_logprobs(self, choice: int, out, prompt=None):
        """The logprobs object of the tokens one engine step added (None when not asked for or none);
        `prompt` (an echo's first chunk): (prompt ids, their logprobs), whose tokens come first."""
        if self.params.logprobs is None or not (out.logprobs or prompt):
            return None
        if self.chat:
            return P.chat_logprobs(out.logprobs, out.token_ids, self.decode)
        lp = P.completion_logprobs(out.logprobs or [], out.token_ids, self.decode, self.offsets[choice], prompt)
        self.offsets[choice] += sum(len(t) for t in lp["tokens"])
        return lp

    async def stream(self, first, sub, include_usage: bool):
        if self.chat:  # OpenAI opens each choice with the role
            yield self._chunk([self._piece(c, None, first=True) for c in range(len(self.finals))])
        item = first
        echoed = set()  # completions with echo: the choices whose prompt went out (in their first chunk)
        while item is not None:
            choice, out = item
            self.take(choice, out)
            if out.finished and (out.output.finish_reason == "error" or out.output.error):  # failed, or ended
                # by the server (a shutdown, a client that stopped reading): the stream says why
                yield P.sse(P.error_body(out.output.error or "the request failed"))
            elif self.echo[1] and choice not in echoed:  # the prompt (and its logprobs), then this step's
                echoed.add(choice)
                scored = out.output.prompt_logprobs if out.finished else out.prompt_logprobs
                lp = self._step_logprobs(choice, out, (self.prompts[choice // self.n], scored))
                reason = P.finish_reason(out.output.finish_reason) if out.finished else None
                yield self._chunk([self._piece(choice, self._prompt_text(choice) + out.text, reason, logprobs=lp)])
            elif out.text or out.finished or (out.logprobs and self.params.logprobs is not None):
                reason = P.finish_reason(out.output.finish_reason) if out.finished else None
                lp = self._step_logprobs(choice, out)
                if out.text and reason is not None and self.chat:  # the last text, then the end of the choice
                    yield self._chunk([self._piece(choice, out.text, logprobs=lp)])
                    yield self._chunk([self._piece(choice, None, reason)])
                else:
                    yield self._chunk([self._piece(choice, out.text, reason, logprobs=lp)])
            item = await anext(sub, None)
        if include_usage:
            yield self._chunk([], self.usage(), self.cache_extension())
        yield P.sse("[DONE]")
