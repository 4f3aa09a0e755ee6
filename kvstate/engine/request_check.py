"""What the scheduler checks of a request before queueing it (no torch).

A malformed or oversized request is not an exception: `Scheduler.add` queues it REJECTED with
the reason this returns, and the next `postprocess` reports it with the finished ones, so one bad
request in a batch (or on a server) never stops the others.
"""

from __future__ import annotations

import operator
from typing import Callable

from kvstate.engine.params import SamplingParams


def check_request(cfg, blocks_for: Callable[[int], int], request_id, prompt, params, *, in_use: bool,
                  can_detokenize: bool) -> tuple[list[int], str | None]:
    """(normalized prompt, None) or (whatever could be read, the reason to reject). `cfg` is the
    SchedulerConfig, `blocks_for(n)` the KV blocks n tokens need, `in_use` whether the request id is taken."""
    if in_use:
        return [], f"request id {request_id!r} is already in use"
    if not isinstance(params, SamplingParams):
        return [], f"params must be SamplingParams, got {type(params).__name__}"
    try:
        params.validate()
    except ValueError as e:
        return [], str(e)
    tokens, problem = prompt_tokens(prompt, cfg.vocab_size)
    if problem is not None:
        return tokens, problem
    if not tokens:
        return tokens, "prompt is empty"
    if len(tokens) > cfg.max_model_len:
        return tokens, (f"prompt has {len(tokens)} tokens, more than the model's maximum length "
                        f"{cfg.max_model_len}")
    # KV is written for every token but the last one sampled; the pool must hold one sequence
    final = max(cfg.max_model_len, len(tokens) + 1)
    if params.max_tokens is not None:
        final = min(final, len(tokens) + params.max_tokens)
    need = blocks_for(final - 1)
    if need > cfg.num_blocks:
        return tokens, (f"prompt plus max_tokens needs up to {need} KV blocks of {cfg.block_size} tokens; "
                        f"the cache pool holds {cfg.num_blocks}")
    problem = stop_tokens_problem(params.stop_token_ids, cfg.vocab_size)
    if problem is not None:
        return tokens, problem
    if params.stop and not can_detokenize:
        return tokens, "stop strings need a detokenizer, and none was given to the scheduler"
    return tokens, None


def prompt_tokens(prompt, vocab_size: int) -> tuple[list[int], str | None]:
    """(the prompt's token ids, None) or (those read before the first bad one, why it is bad): each an
    integer in the vocabulary. The engine's check, and the server's before it answers 400."""
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
        return [], f"prompt must be a list of token ids, got {type(prompt).__name__}"
    tokens: list[int] = []
    for i, t in enumerate(prompt):
        try:
            if isinstance(t, bool):
                raise TypeError
            tokens.append(operator.index(t))
        except TypeError:
            return tokens, f"prompt token {i} is {t!r}, not an integer token id"
        if not 0 <= tokens[-1] < vocab_size:
            return tokens, f"prompt token {i} is {tokens[-1]}, outside the vocabulary [0, {vocab_size})"
    return tokens, None


def stop_tokens_problem(stop_token_ids, vocab_size: int) -> str | None:
    """Why `stop_token_ids` cannot be used (ids outside the vocabulary, the first few named), or None."""
    outside = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if not outside:
        return None
    more = f" and {len(outside) - 4} more" if len(outside) > 4 else ""
    return f"stop_token_ids {outside[:4]}{more} are outside the vocabulary [0, {vocab_size})"
