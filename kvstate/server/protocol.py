"""OpenAI's reply shapes, built from the engine's outputs: errors, choices, usage, logprobs, chunks.

Plain dicts (serialized by FastAPI/json), named as in OpenAI's API reference. Error replies are
`{"error": {"message", "type", "param", "code"}}` with a 4xx status for anything the client sent.
"""

from __future__ import annotations

import json
import time
import uuid


class ApiError(Exception):
    """A request the server refuses: becomes OpenAI's error JSON with `status`."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def finish_reason(reason: str | None) -> str | None:
    """OpenAI knows "stop" and "length"; an aborted request ends as "stop" there is no one to read."""
    return {"abort": "stop"}.get(reason, reason)


CACHE_FIELD = "kvstate_cache"  # the extension object beside `usage`: per prompt, its cache report


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """With prefix caching on (`cached_tokens` not None), the prompt tokens served from the cache
    in `prompt_tokens_details.cached_tokens`, as OpenAI and vLLM report them."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def sse(payload) -> str:
    """One server-sent event carrying JSON (or the literal [DONE])."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


# -- logprobs ------------------------------------------------------------------------------------
# The engine gives per token (logprob of the chosen token, [(token id, logprob), ...] top-n).

def completion_logprobs(entries, token_ids: list[int], decode, offset: int = 0, prompt=None) -> dict:
    """The legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset.
    top_logprobs holds the chosen token and the n most likely (vLLM's). `prompt` (echo): (prompt ids,
    RequestOutput.prompt_logprobs or None), whose tokens come first (the first one's logprob None)."""
    tokens, offsets, lps, tops = [], [], [], []

    def add(tid: int, lp, top: dict | None) -> None:
        nonlocal offset
        text = decode(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        lps.append(lp)
        tops.append(top)

    if prompt is not None:
        ids, scored = prompt
        for p, tid in enumerate(ids):
            entry = scored[p] if scored is not None and p < len(scored) else None
            add(tid, None if entry is None else entry[tid].logprob,
                None if entry is None else {decode(t): e.logprob for t, e in reversed(entry.items())})
    for tid, (lp, top) in zip(token_ids, entries):
        add(tid, lp, {**{decode(t): v for t, v in top}, decode(tid): lp})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(scored, decode) -> list | None:
    """vLLM's `prompt_logprobs` of a completion choice: None, then {token id: {logprob, rank, decoded_token}}."""
    if scored is None:
        return None
    return [None if e is None else {str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": decode(t)}
                                    for t, v in e.items()} for e in scored]


def chat_logprobs(entries, token_ids: list[int], decode) -> dict:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
    def item(tid, lp):
        text = decode(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(tid, lp), "top_logprobs": [item(t, l) for t, l in top]}
                        for tid, (lp, top) in zip(token_ids, entries)]}
