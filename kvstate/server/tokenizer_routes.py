"""The tokenizer endpoints in vLLM's shapes: POST /tokenize, POST /detokenize, GET /tokenizer_info.

lm-evaluation-harness's default tokenizer backend probes /tokenizer_info and /tokenize and, where
they answer, tokenizes through the server instead of downloading the model's tokenizer from the
hub. `model` is optional (when given it must be the served one); unknown fields are a 400.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from kvstate.errors import KvstateError
from kvstate.server.body import ThreadedBodyRoute
from kvstate.server.openai_routes import _check_model, _check_text
from kvstate.server.protocol import ApiError
from kvstate.server.schemas import MAX_MESSAGES, TokenIds, _at_most

router = APIRouter(route_class=ThreadedBodyRoute)


class _Message(BaseModel):
    role: str
    content: str


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = Field(None, description="a text (or give messages)")
    messages: Annotated[list[_Message] | None, _at_most(MAX_MESSAGES)] = Field(
        None, description="a chat, rendered with the model's chat template")
    add_special_tokens: bool | None = Field(None, description="default: true for a prompt, false for messages")
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: TokenIds = Field(..., description="token ids")


def _tokenizer(loop):
    if loop.llm.tokenizer is None:
        raise ApiError("this model has no tokenizer.json: the server cannot tokenize", status=404,
                       type="not_found_error")
    return loop.llm.tokenizer


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    loop = request.app.state.engine_loop
    _check_model(loop, body)
    tok = _tokenizer(loop)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError("give either prompt or messages", param="prompt")
    most = request.app.state.limits.prompt_chars(loop.core.max_model_len)
    text = body.prompt if body.prompt is not None else "".join(m.content for m in body.messages)
    _check_text(text, most, "prompt" if body.prompt is not None else "messages")

    def run() -> list[int]:
        if body.prompt is not None:
            return tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        messages = [m.model_dump() for m in body.messages]
        try:
            rendered = tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        except KvstateError as exc:
            raise ApiError(str(exc), param="messages") from None
        return tok.encode(rendered, add_special_tokens=bool(body.add_special_tokens))

    ids = await run_in_threadpool(run)
    out = {"count": len(ids), "max_model_len": loop.core.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [tok.decode([t], skip_special_tokens=False) for t in ids]
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    loop = request.app.state.engine_loop
    _check_model(loop, body)
    tok = _tokenizer(loop)
    vocab = loop.core.plan.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(f"token {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": await run_in_threadpool(tok.decode, body.tokens, skip_special_tokens=False)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    loop = request.app.state.engine_loop
    tok = _tokenizer(loop)
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token, "bos_token": tok.bos_token,
            "pad_token": tok.pad_token, "add_bos_token": tok.add_bos, "chat_template": tok.chat_template,
            "model_max_length": loop.core.max_model_len, "vocab_size": tok.vocab_size}
