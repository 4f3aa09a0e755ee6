"""The engine core: requests in, one step at a time, the news of every request out.

    core = EngineCore(model, plan, tokenizer, EngineConfig(cache_memory=..., max_model_len=...))
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

from collections import deque

from kvstate.engine.budget import engine_budget
from kvstate.engine.cache_report import CacheReport
from kvstate.engine.config import EngineConfig
from kvstate.engine.outputs import CompletionOutput, EngineOutput, RequestOutput
from kvstate.engine.params import SamplingParams
from kvstate.engine.scheduler import Scheduler, SchedulerConfig
from kvstate.engine.sequence import Sequence
from kvstate.engine.speculative.config import SpeculativeConfig
from kvstate.engine.speculative.drafter import Drafter, StepResult
from kvstate.errors import KvstateError

class EngineCore:
    def __init__(self, model, plan, tokenizer=None, config: EngineConfig | None = None, *, runner_class=None):
        """`config`: the engine's settings (`EngineConfig`; its defaults where None); the pools'
        budget comes from `kvstate.engine.budget`. `runner_class`: ModelRunner by default; tensor
        parallelism's rank-0 runner (kvstate.parallel.engine)."""
        from kvstate.engine.runner import ModelRunner

        self.config = config = EngineConfig() if config is None else config
        self.plan, self.tokenizer = plan, tokenizer
        budget = engine_budget(config, model, plan)
        self.draft_cache_bytes = budget.draft_cache_bytes  # what a draft model's pools take out of cache_memory
        self.runner = (runner_class or ModelRunner)(
            model, plan, cache_bytes=budget.cache_bytes, block_size=config.block_size, num_slots=budget.num_slots,
            max_model_len=budget.max_model_len, conv_window=config.conv_window, seed=config.seed,
            **({"mtp": True} if budget.mtp else {}))
        # a model without KV layers has block ids for bookkeeping only; with KV layers the pool caps the length
        self.max_model_len = min(budget.max_model_len, self.runner.sizes.num_blocks * config.block_size)
        self.scheduler = Scheduler(self._scheduler_config(),
                                   detokenize=tokenizer.decode if tokenizer is not None else None)
        self.peak_cache_bytes = {"kv": 0, "state": 0}
        self.last_step = None  # the SchedulerOutput of the last step (what the explorer's timeline shows)
        self.proposer = None  # speculative decoding's Proposer
        self.set_proposer(config.speculative_config)
        # output tokens already reported, per sequence (not per id: a rejected duplicate id is another request)
        self._sent: dict[Sequence, int] = {}
        self.cache_reports: deque = deque(maxlen=32)  # (request id, CacheReport) of the last finished requests

    def _scheduler_config(self) -> SchedulerConfig:
        c, sizes = self.config, self.runner.sizes
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else set()
        return SchedulerConfig(
            num_blocks=sizes.num_blocks, block_size=c.block_size, num_slots=sizes.num_slots,
            max_model_len=self.max_model_len, vocab_size=self.plan.vocab_size, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, eos_token_ids=frozenset(eos),
            enable_prefix_caching=c.enable_prefix_caching, snapshot_interval=c.snapshot_interval,
            snapshot_repeat=c.snapshot_repeat, prefix_eviction=c.prefix_eviction, prefix_align=c.prefix_align,
            prefix_costs=self._prefix_costs())

    @property
    def model(self):
        return self.runner.model

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on (callers then give snapshot hints where chats' messages end)."""
        return self.scheduler.prefix is not None

    def _prefix_costs(self) -> tuple[float, float, int, int]:
        """(prefill FLOPs per token, per token pair, slot bytes, block bytes) for the snapshot eviction:
        2 per weight per token; attention's QK and PV ~ 2 per cached K/V element per query (GQA's
        extra query heads left out: a proxy, the same for every snapshot of this model)."""
        spec, sizes = self.runner.cache_spec, self.runner.sizes
        weights = sum(p.numel() for p in self.model.parameters())
        kv_elems = spec.kv_bytes_per_token / 4  # the runner's KV pools are fp32
        return float(2 * weights), float(2 * kv_elems), sizes.slot_bytes, sizes.block_bytes

    def set_proposer(self, config, drafter: Drafter | None = None):
        """Speculative decoding from now on: `config` a SpeculativeConfig or vLLM's dict (None: plain
        decoding); `drafter` one made already (else the one `config` names). Only between requests:
        a drafter holds per-request state. Returns the new Proposer (or None)."""
        if self.has_unfinished():
            raise KvstateError("set_proposer: requests are in flight")
        self.proposer = None
        self.runner.keep_hidden = False
        if config is None:
            return None
        from kvstate.engine.speculative.proposer import Proposer, make_drafter

        config = SpeculativeConfig.from_dict(config)
        drafter = make_drafter(config, self) if drafter is None else drafter
        if drafter.wants_hidden and not self.runner.mtp:
            raise KvstateError("speculative_config: the MTP head drafts only in an engine whose pools hold its KV "
                               "(built with speculative_config method 'mtp')")
        self.runner.keep_hidden = drafter.wants_hidden
        self.proposer = Proposer(config, drafter, self.max_model_len)
        return self.proposer

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
        if self.proposer is not None:  # roll verified states back, then count and draft for the next step
            self.runner.keep(kept)
            self.proposer.after_step(StepResult(step, out.token_ids, kept, [*finished, *step.preempted], out.hidden),
                                     self.scheduler.running)
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
