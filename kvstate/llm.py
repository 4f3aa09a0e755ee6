"""`LLM`: the offline user API over the engine core, named as in vLLM.

    from kvstate import LLM, SamplingParams
    llm = LLM("path/to/checkpoint" or "org/name", cache_memory="4GiB")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hi"}], {"max_tokens": 32})

It turns prompts (text, token ids, or dicts of PROMPT_KEYS) and params (SamplingParams
or dicts) into engine requests, one per sample, and routes what every `EngineCore.step()`
returns to the collector of its prompt. Whichever `generate`/`stream` iterator steps the engine,
every request's events reach their own iterator. A bad prompt or bad params fail that prompt
alone (finish_reason "error", `error` says why); the others are served.
"""

from __future__ import annotations

import itertools
import os
import warnings
from typing import Iterator

from kvstate.engine.collector import RequestCollector
from kvstate.engine.config import EngineConfig
from kvstate.engine.core import EngineCore
from kvstate.engine.outputs import EngineOutput, RequestOutput, StreamEvent
from kvstate.engine.params import SamplingParams
from kvstate.engine.router import RequestRouter, fan_out
from kvstate.errors import KvstateError, UnknownTokenWarning

# what a prompt dict may hold: "prompt" (text), "prompt_token_ids", "cache_prefix" (where prefix
# caching keeps a state snapshot), "cache_salt" (shares the cache only with the same salt)
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_prefix", "cache_salt")


def cache_prefix_points(tokenizer, value, ids: list[int]) -> dict[int, str]:
    """A request's `cache_prefix` as snapshot hints {position: "prefix"}: a token count, a text the
    prompt starts with (as tokens, encoded as the prompt was), or a list of either. With prefix
    caching the state is kept there, so a later prompt that shares it resumes there."""
    if value is None:
        return {}
    out = {}
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, str):
            if tokenizer is None:
                raise KvstateError("cache_prefix as text needs the checkpoint's tokenizer.json")
            head = tokenizer.encode(item)
            if list(ids[:len(head)]) != head:
                raise KvstateError(f"cache_prefix {item!r:.40} is not how the prompt starts (as tokens)")
            item = len(head)
        if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= len(ids):
            raise KvstateError(f"cache_prefix must be a token count in [1, {len(ids)}] or a text the prompt "
                               f"starts with, got {item!r:.40}")
        out[item] = "prefix"
    return out


def check_salt(salt) -> None:
    """A cache_salt is None or a non-empty string (vLLM's rule)."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise KvstateError(f"cache_salt must be a non-empty string, got {salt!r:.40}")


def _set_activation_dtype(config: EngineConfig) -> None:
    """Apply `activation_dtype` (kernels.activation: process-wide, so the last LLM built sets it), or
    one clear error where this CPU or the kernels cannot run it."""
    from kvstate.kernels.activation import set_activation_dtype

    if config.activation_dtype != "fp32" and config.tensor_parallel_size != 1:
        raise KvstateError(f"activation_dtype {config.activation_dtype}: not with tensor parallelism (its worker "
                           "processes keep fp32 math)")
    set_activation_dtype(config.activation_dtype)


class LLM:
    def __init__(self, model: str | os.PathLike, *, load_progress=None, config: EngineConfig | None = None,
                 **fields):
        """`fields`: the engine's settings, as `EngineConfig`'s fields (each documented there), or
        a whole `config`. `load_progress(bytes_done, bytes_total)`, if given, is called as the
        weights load (a progress bar). `tensor_parallel_size` N > 1: the model and its caches
        sharded over N processes (this one and N - 1 it spawns, gloo on 127.0.0.1; or torchrun's);
        `cache_memory` is then per process."""
        from kvstate.hub import resolve_checkpoint
        from kvstate.models.loader import load_model

        if config is not None and fields:
            raise KvstateError("give LLM an EngineConfig or its fields as keywords, not both")
        config = EngineConfig(**fields) if config is None else config
        _set_activation_dtype(config)
        path = resolve_checkpoint(model)
        runner_class = None
        if config.tensor_parallel_size != 1:
            from kvstate.parallel.engine import start

            module, plan, runner_class = start(path, config.tensor_parallel_size, weight_dtype=config.weight_dtype)
        else:
            module, plan = load_model(path, progress=load_progress, weight_dtype=config.weight_dtype)
        tokenizer = None
        if (path / "tokenizer.json").exists():
            from kvstate.models.tokenizer import Tokenizer

            tokenizer = Tokenizer(path)
        self.engine = EngineCore(module, plan, tokenizer, config, runner_class=runner_class)
        self._router = RequestRouter(self.engine)  # engine request id -> (collector, sample)
        self._ids = itertools.count()
        self._warned_prompts: set[str] = set()  # prompt texts already warned about unknown words

    # what the engine is made of (read-only views for the CLI, benchmarks and tests)
    model = property(lambda self: self.engine.model)
    plan = property(lambda self: self.engine.plan)
    tokenizer = property(lambda self: self.engine.tokenizer)
    runner = property(lambda self: self.engine.runner)
    max_model_len = property(lambda self: self.engine.max_model_len)
    peak_cache_bytes = property(lambda self: self.engine.peak_cache_bytes)

    def cache_bytes_in_use(self) -> dict[str, int]:
        return self.engine.cache_bytes_in_use()

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also when the program exits)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def stats(self) -> dict:
        """The engine's counters now: requests, pool occupancy and, with prefix caching, the prompt
        tokens served from cache, hit rate, snapshots held and their bytes."""
        return self.engine.stats()

    # -- the API ---------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, *, cache_salt: str | None = None) -> list[RequestOutput]:
        """Run prompts to completion; one RequestOutput per prompt, in the order given.
        `sampling_params`: a SamplingParams or dict for all, or a list with one per prompt.
        `cache_salt`: with prefix caching, these prompts share cached blocks and snapshots only with
        requests of the same salt (a prompt dict's own "cache_salt" takes precedence)."""
        return [ev.output for ev in self._run(self._submit(prompts, sampling_params, salt=cache_salt)) if ev.finished]

    def stream(self, prompts, sampling_params=None, *, cache_salt: str | None = None) -> Iterator[StreamEvent]:
        """Yield every new token of every request as it comes; each prompt's last event carries its
        output. The closing events come in prompt order (one finishing early waits for those before
        it). Closing the iterator early aborts its unfinished requests. `cache_salt`: as `generate`."""
        return self._run(self._submit(prompts, sampling_params, salt=cache_salt))

    def chat(self, messages, sampling_params=None, *, add_generation_prompt: bool = True,
             cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list of
        them, rendered with the checkpoint's chat template (its special tokens are in the text).
        With prefix caching the state is kept where each message ends (a later conversation that
        shares the system prompt or a document message resumes there)."""
        if self.tokenizer is None:
            raise KvstateError("this checkpoint has no tokenizer.json: chat needs its chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts, hints = [], []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(list(conversation), add_generation_prompt=add_generation_prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            self._warn_unknown(text, ids, stacklevel=3)  # the caller of chat()
            prompts.append({"prompt": text, "prompt_token_ids": ids})
            ends = []
            if self.engine.prefix_caching:
                ends = self.tokenizer.message_ends(list(conversation), ids, add_generation_prompt=add_generation_prompt)
            hints.append(dict.fromkeys(ends, "chat"))
        collectors = self._submit(prompts, sampling_params, hints, salt=cache_salt)
        return [ev.output for ev in self._run(collectors) if ev.finished]

    # -- requests in -----------------------------------------------------------------------------
    def _submit(self, prompts, sampling_params, hints: list[dict] | None = None,
                salt: str | None = None) -> list[RequestCollector]:
        """`hints`: per prompt, {position: kind} where prefix caching keeps a snapshot (chat message ends);
        `salt`: the cache_salt of prompts whose dict names none."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], int) and not isinstance(prompts[0], bool)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise KvstateError(f"prompts must be a string, a list of token ids, or a list of prompts, "
                               f"got {type(prompts).__name__}")
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise KvstateError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        collectors = []
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            request_id = next(self._ids)
            try:
                sp = SamplingParams.coerce(p)
                text, ids = self._prompt(prompt)
                value = prompt.get("cache_prefix") if isinstance(prompt, dict) else None
                points = {**(hints[index] if hints else {}), **cache_prefix_points(self.tokenizer, value, ids)}
                cache_salt = prompt.get("cache_salt", salt) if isinstance(prompt, dict) else salt
                check_salt(cache_salt)
            except KvstateError as exc:
                collectors.append(RequestCollector.failed(index, request_id, prompt, str(exc)))
                continue
            collector = RequestCollector(index, request_id, text, ids, sp.n)
            for child, k, child_params in fan_out(request_id, sp):
                self._router.add(collector, child, k, ids, child_params, snapshot_hints=points, cache_salt=cache_salt)
            collectors.append(collector)
        return collectors

    def _prompt(self, prompt) -> tuple[str | None, object]:
        """(prompt text or None, token ids as given: the scheduler checks them one by one)."""
        if isinstance(prompt, dict):
            unknown = [k for k in prompt if k not in PROMPT_KEYS]
            if unknown:
                raise KvstateError(f"unknown prompt key {unknown[0]!r:.40}: a prompt dict takes "
                                   f"{', '.join(PROMPT_KEYS)}")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), prompt["prompt_token_ids"]
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise KvstateError("this checkpoint has no tokenizer.json: give prompts as lists of token ids")
            ids = self.tokenizer.encode(prompt)
            self._warn_unknown(prompt, ids, stacklevel=5)  # the caller of generate() / stream()
            return prompt, ids
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise KvstateError(f"prompt must be a string or a list of token ids, "
                           f"got {type(prompt).__name__} ({prompt!r:.40})")

    def _warn_unknown(self, text: str, ids: list[int], *, stacklevel: int) -> None:
        """Warn once per distinct prompt whose words the tokenizer does not know: the model reads
        `<unk>` for each, silently (the shipped models know 1,321 tokens, see their model cards)."""
        unk = self.tokenizer.unk_id
        if unk is None or unk not in ids or text in self._warned_prompts:
            return
        self._warned_prompts.add(text)
        words = self.tokenizer.unknown_words(text)
        count = len(words) or ids.count(unk)
        first = f", first {words[0]!r}" if words else ""
        warnings.warn(f"the prompt has {count} word{'s' * (count != 1)} this checkpoint's tokenizer does not "
                      f"know{first}: the model reads its unknown token for {'them' if count != 1 else 'it'}",
                      UnknownTokenWarning, stacklevel=stacklevel)

    # -- outputs out -----------------------------------------------------------------------------
    def _step(self) -> list[EngineOutput]:
        """One engine step; every output goes to the collector of its request."""
        outs = self.engine.step()
        self._router.route(outs)  # a request of a closed stream (aborted) or added to the engine directly: dropped
        return outs

    def _run(self, collectors: list[RequestCollector]) -> Iterator[StreamEvent]:
        try:
            next_final = 0
            while next_final < len(collectors):
                for c in collectors:
                    while c.events:
                        yield c.events.popleft()
                while next_final < len(collectors) and collectors[next_final].done:
                    c = collectors[next_final]
                    yield StreamEvent(c.index, None, "", True, c.output)
                    next_final += 1
                if next_final < len(collectors):
                    if not self.engine.has_unfinished():
                        raise RuntimeError("requests are unfinished but the engine has nothing left to run")
                    self._step()
        finally:  # closed early (or failed): stop what is still running for this caller
            self._router.abort(self._router.of(collectors))
