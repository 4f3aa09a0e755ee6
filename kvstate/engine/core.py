"""The engine core: requests in, one step at a time, the news of every request out.

    core = EngineCore(model, plan, tokenizer, cache_memory=..., max_model_len=...)
    core.add_request("a", [1, 2, 3], SamplingParams(max_tokens=8))
    while core.has_unfinished():
        for out in core.step():          # EngineOutput per request that changed in this step
            ...                          # out.token_ids, out.text, out.finished, out.output

`step()` is schedule (torch-free), execute (the runner: slot copies, forward, sampling with
per-request state), postprocess (append, stop checks, free blocks and slots), and it returns
the new output of EVERY request that changed, whoever asked for it: the offline `LLM` routes
them to its per-request collectors, a server's loop to its connections. The core holds no
user-API state (prompt texts, n-sample grouping, stream iterators).
"""

from __future__ import annotations

import operator
from collections import deque

from kvstate.engine.cache_report import CacheReport
from kvstate.engine.outputs import CompletionOutput, EngineOutput, RequestOutput
from kvstate.engine.params import SamplingParams
from kvstate.engine.scheduler import Scheduler, SchedulerConfig
from kvstate.engine.sequence import Sequence
from kvstate.errors import KvstateError

DEFAULT_CACHE_FRACTION = 0.2  # of the memory available when no cache budget is given


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
    from kvstate.engine.speculative.config import SpeculativeConfig
    from kvstate.engine.speculative.draft_model import draft_pool_bytes
    from kvstate.hub import resolve_checkpoint

    config = SpeculativeConfig.from_dict(speculative_config)
    if config.model is None:
        return None
    spec = cache_spec(read_plan(resolve_checkpoint(config.model)), kv_dtype="float32", state_dtype="float32",
                      conv_dtype="float32")
    return draft_pool_bytes(spec, max_num_seqs=max_num_seqs, block_size=block_size, max_tokens=0,
                            k=config.num_speculative_tokens)


def _uses_mtp(speculative_config, model, plan) -> bool:
    """Whether the engine drafts with the checkpoint's MTP head; one error where it has none."""
    if speculative_config is None:
        return False
    from kvstate.engine.speculative.config import SpeculativeConfig

    if SpeculativeConfig.from_dict(speculative_config).method != "mtp":
        return False
    if getattr(model, "mtp", None) is None:
        raise KvstateError(f"speculative_config: method 'mtp' needs a checkpoint with multi-token-prediction "
                           f"weights (mtp.* and mtp_num_hidden_layers in config.json); {plan.name} has none")
    return True


class EngineCore:
    def __init__(self, model, plan, tokenizer=None, *, cache_memory: int | str | None = None, block_size: int = 16,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 conv_window: str = "kernel", seed: int | None = None, enable_prefix_caching: bool = False,
                 snapshot_interval: int | str | None = "auto", prefix_eviction: str = "marconi", prefix_align: int = 1,
                 num_snapshot_slots: int | None = None, snapshot_repeat: bool = True, speculative_config=None,
                 runner_class=None, snapshot_memory: int | str | None = None):
        """Prefix caching (`kvstate.engine.prefix_cache`) keeps state snapshots in `num_snapshot_slots`
        spare state slots (default: 2 per sequence, at most half of the cache budget) out of the same
        budget as the KV blocks; or as many as `snapshot_memory` bytes hold (a size such as "256MiB").
        `speculative_config`: vLLM's dict (`kvstate.engine.speculative`).
        `runner_class`: ModelRunner by default; tensor parallelism's rank-0 runner (kvstate.parallel.engine)."""
        from kvstate.engine.runner import ModelRunner
        from kvstate.memory import parse_size

        self.plan, self.tokenizer = plan, tokenizer
        max_model_len = check_max_model_len(max_model_len, plan.max_position_embeddings)
        if isinstance(cache_memory, str):
            cache_memory = parse_size(cache_memory, "--cache-memory")
        from kvstate.cache.spec import cache_spec

        # under tensor parallelism the model holds its rank's plan (its heads' cache) and the ranks share the machine
        local = getattr(model, "plan", None) or plan
        ranks = getattr(getattr(model, "tp_group", None), "size", 1)
        mtp = _uses_mtp(speculative_config, model, plan)  # the MTP head's KV is part of every request's cache
        spec = cache_spec(local, kv_dtype="float32", state_dtype="float32", conv_dtype="float32",
                          conv_window=conv_window, mtp=mtp)
        draft = _draft_costs(speculative_config, max_num_seqs, block_size)  # (fixed, per token) or None
        if cache_memory is None:
            need = max_num_seqs * (spec.state_bytes + max_model_len * spec.kv_bytes_per_token)
            if enable_prefix_caching:
                need += 2 * max_num_seqs * spec.state_bytes
            if draft is not None:
                need += draft[0] + max_num_seqs * max_model_len * draft[1]
            cache_memory = min(int(DEFAULT_CACHE_FRACTION * available_memory()) // ranks, need)
        spare = 0
        if enable_prefix_caching:
            spare = snapshot_slots(local, conv_window, cache_memory, max_num_seqs, num_snapshot_slots, snapshot_memory)
        self.draft_cache_bytes = 0  # what a draft model's pools take out of cache_memory
        if draft is not None:
            fixed, per_token = draft
            left = cache_memory - fixed - (max_num_seqs + spare) * spec.state_bytes
            tokens = max(0, left) // (spec.kv_bytes_per_token + per_token) if spec.kv_bytes_per_token else \
                max_num_seqs * max_model_len  # no target KV: the draft holds full-length requests
            self.draft_cache_bytes = fixed + tokens * per_token
        self.runner = (runner_class or ModelRunner)(
            model, plan, cache_bytes=cache_memory - self.draft_cache_bytes, block_size=block_size,
            num_slots=max_num_seqs + spare, max_model_len=max_model_len, conv_window=conv_window, seed=seed,
            **({"mtp": True} if mtp else {}))
        sizes = self.runner.sizes
        # a model without KV layers has block ids for bookkeeping only; with KV layers the pool caps the length
        self.max_model_len = min(max_model_len, sizes.num_blocks * block_size)
        eos = tokenizer.eos_token_ids if tokenizer is not None else set()
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=sizes.num_blocks, block_size=block_size, num_slots=sizes.num_slots,
            max_model_len=self.max_model_len, vocab_size=plan.vocab_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, eos_token_ids=frozenset(eos),
            enable_prefix_caching=enable_prefix_caching, snapshot_interval=snapshot_interval,
            snapshot_repeat=snapshot_repeat, prefix_eviction=prefix_eviction, prefix_align=prefix_align,
            prefix_costs=self._prefix_costs()),
            detokenize=tokenizer.decode if tokenizer is not None else None)
        self.peak_cache_bytes = {"kv": 0, "state": 0}
        self.last_step = None  # the SchedulerOutput of the last step (what the explorer's timeline shows)
        self.proposer = None  # speculative decoding's Proposer
        if speculative_config is not None:
            from kvstate.engine.speculative.proposer import make_proposer

            self.proposer = make_proposer(speculative_config, self)
        # output tokens already reported, per sequence (not per id: a rejected duplicate id is another request)
        self._sent: dict[Sequence, int] = {}
        self.cache_reports: deque = deque(maxlen=32)  # (request id, CacheReport) of the last finished requests

    @property
    def model(self):
        return self.runner.model

    def _prefix_costs(self) -> tuple[float, float, int, int]:
        """(prefill FLOPs per token, per token pair, slot bytes, block bytes) for the snapshot eviction:
        2 per weight per token; attention's QK and PV ~ 2 per cached K/V element per query (GQA's
        extra query heads left out: a proxy, the same for every snapshot of this model)."""
        spec, sizes = self.runner.cache_spec, self.runner.sizes
        weights = sum(p.numel() for p in self.model.parameters())
        kv_elems = spec.kv_bytes_per_token / 4  # the runner's KV pools are fp32
        return float(2 * weights), float(2 * kv_elems), sizes.slot_bytes, sizes.block_bytes

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id, prompt_token_ids, params: SamplingParams | None = None, *,
                    group=None, snapshot_hints: dict[int, str] | None = None, cache_salt: str | None = None) -> None:
        """Queue a request (n must be 1: the caller fans samples out). A malformed one is reported
        by the next step as finished with an error. `group`: the client request it belongs to
        (the scheduler admits groups in turn); None: its own. `snapshot_hints` {prompt position:
        "chat" or "prefix"}: where prefix caching keeps a state snapshot for later requests to resume from.
        `cache_salt`: cached blocks and snapshots are shared only between requests with the same salt."""
        params = SamplingParams() if params is None else params
        if isinstance(params, SamplingParams) and params.n != 1:
            raise KvstateError("EngineCore takes one sample per request: add n requests (SamplingParams.for_sample)")
        refuse = None
        if getattr(params, "prompt_logprobs", None) is not None and not self.runner.scores_prompts:
            refuse = "prompt_logprobs is not supported with tensor parallelism (--tp): run with one rank"
        self.scheduler.add(request_id, prompt_token_ids, params, group=group, snapshot_hints=snapshot_hints,
                           refuse=refuse, cache_salt=cache_salt)

    def abort_request(self, request_id) -> bool:
        """Stop a request now; its final output (finish_reason "abort") comes with the next step."""
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        """Whether a step is still needed: requests to run, or results not yet reported."""
        return self.scheduler.has_work()

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """One engine step; the new output of every request that changed in it."""
        step = self.scheduler.schedule()
        self.last_step = step
        out = self.runner.execute(step)  # an empty step still drops finished requests' state
        if step.is_empty and not self.scheduler.running and self.scheduler.waiting:
            # `Scheduler.add` rejects what the pools can never hold, so this is an engine bug
            self.scheduler.postprocess(step, [])
            raise KvstateError("the cache pools cannot hold the next waiting request (raise --cache-memory)")
        if not step.is_empty:
            for key, used in self.cache_bytes_in_use().items():
                self.peak_cache_bytes[key] = max(self.peak_cache_bytes[key], used)
        want = any(p.logprobs is not None for p in step.sample_params())
        logprobs = list(zip(out.logprobs, out.top_logprobs)) if want else None
        for seq, first, entries in out.prompt_logprobs:  # before postprocess: a request may finish in this step
            seq.add_prompt_logprobs(first, entries)
        finished, kept = self.scheduler.postprocess(step, out.token_ids, logprobs)
        if self.proposer is not None:  # roll verified states back, count, draft for the next step
            self.runner.keep(kept)
            self.proposer.record(step, out.token_ids)
            self.proposer.release([*finished, *step.preempted])
            self.proposer.observe(step)
            self.proposer.propose(self.scheduler.running)
        sampled = step.sample_seqs()
        in_step = {id(s) for s in sampled}
        return [self._news(seq) for seq in sampled + [s for s in finished if id(s) not in in_step]]

    def _news(self, seq: Sequence) -> EngineOutput:
        sent = self._sent.get(seq, 0)
        tokens = seq.output_token_ids[sent:]
        logprobs = list(seq.output_logprobs[sent:]) if seq.params.logprobs is not None else None
        text = seq.detokenizer.take() if seq.detokenizer is not None else ""
        prompt_lp = None
        if seq not in self._sent and seq.params.prompt_logprobs is not None:  # the first news: the prompt's scores
            prompt_lp = seq.prompt_logprobs or [None]
        if not seq.is_finished:
            self._sent[seq] = seq.num_output_tokens
            return EngineOutput(seq.request_id, tokens, text, False, logprobs=logprobs, prompt_logprobs=prompt_lp)
        self._sent.pop(seq, None)
        return EngineOutput(seq.request_id, tokens, text, True, self._request_output(seq), logprobs=logprobs,
                            prompt_logprobs=prompt_lp)

    def _request_output(self, seq: Sequence) -> RequestOutput:
        text = seq.output_text or ""  # None without a tokenizer: token ids only
        logprobs = list(seq.output_logprobs) if seq.params.logprobs is not None else None
        done = CompletionOutput(0, text, list(seq.output_token_ids), seq.finish_reason, seq.stop_reason, logprobs)
        cached = seq.num_cached_tokens if self.scheduler.prefix is not None else None
        prompt_lp = (seq.prompt_logprobs or [None]) if seq.params.prompt_logprobs is not None else None
        if prompt_lp is not None and self.tokenizer is not None:  # each token's text, as vLLM's decoded_token
            for entry in prompt_lp[1:]:
                for tok, lp in entry.items():
                    lp.decoded_token = self.tokenizer.decode([tok], skip_special_tokens=False)
        report = seq.cache_report
        if report is None and self.scheduler.prefix is None and seq.error is None:
            report = CacheReport.off(seq.num_prompt_tokens)
        if report is not None:
            self.cache_reports.append((seq.request_id, report))
        return RequestOutput(seq.request_id, None, seq.prompt_token_ids, [done], error=seq.error,
                             metrics=seq.metrics(), num_cached_tokens=cached, prompt_logprobs=prompt_lp,
                             cache_report=report)

    # -- pool usage -----------------------------------------------------------------------------
    def cache_bytes_in_use(self) -> dict[str, int]:
        """Bytes of the pools owned by running sequences now: KV blocks and state slots apart."""
        sizes = self.runner.sizes
        used_slots = sizes.num_slots - self.scheduler.slots.num_free_slots
        return {"kv": self.scheduler.blocks.num_used_blocks * sizes.block_bytes, "state": used_slots * sizes.slot_bytes}

    def stats(self) -> dict[str, int]:
        """Requests and pool occupancy now (what a server's metrics endpoint would report). Slots and
        blocks that only prefix-cache snapshots hold are `*_held`, apart from those requests use."""
        s, sizes = self.scheduler, self.runner.sizes
        held_slots, held_blocks = s.prefix.cache.held() if s.prefix is not None else (0, 0)
        blocks = s.blocks.num_used_blocks - held_blocks
        slots = sizes.num_slots - s.slots.num_free_slots - held_slots
        held = {"kv_blocks_held": held_blocks, "state_slots_held": held_slots} if s.prefix is not None else {}
        return {"num_running": len(s.running), "num_waiting": len(s.waiting),
                "kv_blocks_used": blocks, "kv_blocks_total": sizes.num_blocks,
                "state_slots_used": slots, "state_slots_total": sizes.num_slots, **held,
                "kv_bytes_in_use": blocks * sizes.block_bytes, "state_bytes_in_use": slots * sizes.slot_bytes,
                **(s.prefix.cache.report() if s.prefix is not None else {}),
                **(self.proposer.stats() if self.proposer is not None else {})}
