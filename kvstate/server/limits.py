"""What one client may ask of `kvstate serve` (no web framework: the CLI reads the defaults).

    limits = ServerLimits(max_body_bytes=8 << 20, max_prompt_chars=None, max_sequences=64)
    app = create_app(llm, limits=limits, api_key="secret")   # kvstate.server.gate enforces the first

The limits bound the work a single request can cause before any of it is done:

- `max_body_bytes`: a larger body is a 413, answered from its Content-Length before a byte of it
  is read, or as soon as a body without one (chunked) grows past it (`gate.Gate`);
- `max_prompt_chars`: a prompt (or a chat's messages together) longer than this is a 400 before it
  is tokenized; None: 32 characters per token of the model's max_model_len (more than any
  tokenizer packs in a token on text, so a prompt that could fit the model is never refused);
- `max_sequences`: prompts x n of one request (the engine requests it fans out to); vLLM bounds
  only n, but 1000 prompts x n=16 is as much work as n=16000.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_MAX_SEQUENCES = 64
CHARS_PER_TOKEN = 32
DEFAULT_IDLE_TIMEOUT = 15.0  # seconds a request head or body may stall (kvstate.server.http_timeouts)
DEFAULT_GRACEFUL_SHUTDOWN = 3.0  # seconds SIGTERM waits for requests before cancelling them
# connections asyncio accepts in one go (and the listen queue): each costs the event loop about a
# millisecond to set up, and a burst of 1000 taken at once (uvicorn's 2048) held /health 1.1 s
ACCEPT_BACKLOG = 128


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int | None = None
    max_sequences: int = DEFAULT_MAX_SEQUENCES

    def prompt_chars(self, max_model_len: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return CHARS_PER_TOKEN * max_model_len
