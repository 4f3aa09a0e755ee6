"""How an engine's cache budget is split: the bytes for the pools (a fraction of the
free memory when none is given), the snapshot slots of prefix caching, a draft model's pools
and the MTP head's KV, and the checked max_model_len.

    budget = engine_budget(config, model, plan)   # Budget(cache_bytes, draft_cache_bytes, num_slots, ...)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from kvstate.errors import KvstateError

DEFAULT_CACHE_FRACTION = 0.2  # of the memory available when no cache budget is given


@dataclass(frozen=True)
class Budget:
    cache_bytes: int  # the runner's pools (the draft model's already taken out)
    draft_cache_bytes: int  # a draft model's pools, out of the configured cache_memory
    num_slots: int  # state slots: max_num_seqs + prefix-cache snapshot slots
    max_model_len: int  # as asked, checked against the model's limit
    mtp: bool  # the pools hold the MTP head's KV too


def engine_budget(config, model, plan) -> Budget:
    """The budget of an `EngineConfig` for `model` (under tensor parallelism it holds its rank's
    plan, its heads' cache, and the ranks share the machine)."""
    from kvstate.cache.spec import cache_spec
    from kvstate.memory import parse_size

    c = config
    max_model_len = check_max_model_len(c.max_model_len, plan.max_position_embeddings)
    cache_memory = parse_size(c.cache_memory, "--cache-memory") if isinstance(c.cache_memory, str) else c.cache_memory
    local = getattr(model, "plan", None) or plan
    ranks = getattr(getattr(model, "tp_group", None), "size", 1)
    mtp = _uses_mtp(c.speculative_config, model, plan)  # the MTP head's KV is part of every request's cache
    spec = cache_spec(local, kv_dtype="float32", state_dtype="float32", conv_dtype="float32",
                      conv_window=c.conv_window, mtp=mtp)
    draft = _draft_costs(c.speculative_config, c.max_num_seqs, c.block_size)  # (fixed, per token) or None
    if cache_memory is None:
        need = c.max_num_seqs * (spec.state_bytes + max_model_len * spec.kv_bytes_per_token)
        if c.enable_prefix_caching:
            need += 2 * c.max_num_seqs * spec.state_bytes
        if draft is not None:
            need += draft[0] + c.max_num_seqs * max_model_len * draft[1]
        cache_memory = min(int(DEFAULT_CACHE_FRACTION * available_memory()) // ranks, need)
    spare = 0
    if c.enable_prefix_caching:
        spare = snapshot_slots(local, c.conv_window, cache_memory, c.max_num_seqs, c.num_snapshot_slots,
                               c.snapshot_memory)
    draft_bytes = 0
    if draft is not None:
        fixed, per_token = draft
        left = cache_memory - fixed - (c.max_num_seqs + spare) * spec.state_bytes
        tokens = max(0, left) // (spec.kv_bytes_per_token + per_token) if spec.kv_bytes_per_token else \
            c.max_num_seqs * max_model_len  # no target KV: the draft holds full-length requests
        draft_bytes = fixed + tokens * per_token
    return Budget(cache_memory - draft_bytes, draft_bytes, c.max_num_seqs + spare, max_model_len, mtp)


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); 8 GiB where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def check_max_model_len(value, limit: int | None) -> int:
    """The max_model_len asked for, checked as vLLM checks it; `limit` is the model's
    max_position_embeddings (None: the model has no limit). None asks for the limit."""
    if value is None:
        return limit or 1 << 20
    if isinstance(value, bool):
        raise KvstateError(f"max_model_len must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise KvstateError(f"max_model_len must be an integer, got {value!r}") from None
    if value < 1:
        raise KvstateError(f"max_model_len must be >= 1, got {value}")
    if limit is not None and value > limit:
        raise KvstateError(f"max_model_len {value} is more than the model's maximum {limit} "
                           f"(max_position_embeddings in config.json)")
    return value


def snapshot_slots(plan, conv_window: str, cache_bytes: int, max_num_seqs: int, asked: int | None,
                   memory: int | str | None = None) -> int:
    """Spare state slots for prefix-cache snapshots: `asked`, or as many as `memory` bytes hold
    (`--snapshot-memory`), else 2 per sequence within half the budget."""
    from kvstate.cache.spec import cache_spec
    from kvstate.memory import parse_size, snapshots_within

    if asked is not None and memory is not None:
        raise KvstateError("give num_snapshot_slots or snapshot_memory, not both")
    if asked is not None:
        if asked < 0:
            raise KvstateError(f"num_snapshot_slots must be >= 0, got {asked}")
        return asked
    spec = cache_spec(plan, kv_dtype="float32", state_dtype="float32", conv_dtype="float32", conv_window=conv_window)
    if memory is not None:
        memory = parse_size(memory, "--snapshot-memory") if isinstance(memory, str) else memory
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 0:
            raise KvstateError(f"--snapshot-memory must be a size in bytes >= 0, got {memory!r:.40}")
        if memory > cache_bytes:
            raise KvstateError(f"--snapshot-memory ({memory} bytes) is more than the cache budget "
                               f"({cache_bytes} bytes)")
        return snapshots_within(spec, memory)
    fit = (cache_bytes // 2) // spec.state_bytes if spec.state_bytes else 2 * max_num_seqs
    return max(1, min(2 * max_num_seqs, fit))


def _draft_costs(speculative_config, max_num_seqs: int, block_size: int) -> tuple[int, int] | None:
    """(fixed bytes, bytes per target token) of a draft model's pools (`draft_pool_bytes`), None without one."""
    if speculative_config is None:
        return None
    from kvstate.cache.spec import cache_spec
    from kvstate.families import read_plan
    from kvstate.engine.speculative.draft_model import draft_pool_bytes
    from kvstate.hub import resolve_checkpoint

    config = speculative_config
    if config.model is None:
        return None
    spec = cache_spec(read_plan(resolve_checkpoint(config.model)), kv_dtype="float32", state_dtype="float32",
                      conv_dtype="float32")
    return draft_pool_bytes(spec, max_num_seqs=max_num_seqs, block_size=block_size, k=config.num_speculative_tokens)


def _uses_mtp(speculative_config, model, plan) -> bool:
    """Whether the engine drafts with the checkpoint's MTP head; one error where it has none."""
    if speculative_config is None:
        return False
    if speculative_config.method != "mtp":
        return False
    if getattr(model, "mtp", None) is None:
        raise KvstateError(f"speculative_config: method 'mtp' needs a checkpoint with multi-token-prediction "
                           f"weights (mtp.* and mtp_num_hidden_layers in config.json); {plan.name} has none")
    return True
