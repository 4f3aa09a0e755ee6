"""The model runner: owns the model, its cache pools and the sampling state, and runs one scheduled step.

Pools are allocated once, from the memory planner's cache spec (`kvstate.cache.spec`) and the
budget split of `pool_sizes`, so the bytes they hold are the planner's prediction. `execute`
takes the scheduler's `SchedulerOutput`: it drops the generators of requests that finished,
carries out the queued state-slot copies, turns the host lists into a packed `Batch` (cu_seqlens,
block tables, KV indices, state slots, each entry's prefill or decode mode), runs the model (each
linear layer writes its states back to its slots) on the rows that must be sampled only, and
samples them with each request's params, penalties and seeded generator.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from kvstate.cache.pools import LayerCache, allocate_pools
from kvstate.cache.spec import cache_spec
from kvstate.engine.block_manager import pool_sizes
from kvstate.engine.prompt_logprobs import step_prompt_logprobs
from kvstate.engine.sampling import RequestGenerators, SampleOutput, sample
from kvstate.engine.rejection import sample_step
from kvstate.kernels.threads import small_ops_serial
from kvstate.layers.recurrence import keep_states
from kvstate.models.batch import Batch, BatchLayout
from kvstate.profiling import timed


@dataclass
class StepHidden:
    """The target's normed last hidden states of one step, for a drafter that reads them (MTP)."""

    states: torch.Tensor  # [T, hidden]: every token of the step
    batch: Batch  # the step's packed batch: entry i's rows start at token_offsets[i]
    resumed: dict[int, torch.Tensor]  # entries that resumed from a snapshot at p -> h_{p-1} [hidden]


def batch_layout(step) -> BatchLayout:
    """The model's view of a scheduled step (models/ knows nothing of the scheduler's field names)."""
    return BatchLayout(query_lens=list(step.num_tokens), context_lens=list(step.context_lens),
                     state_slots=list(step.state_slots), block_tables=[list(t) for t in step.block_tables],
                     block_size=step.block_size, modes=step.modes(), sample_rows=step.sample_indices,
                     captures=list(step.captures) or None)


class ModelRunner:
    scores_prompts = True  # prompt_logprobs: the LM head runs on rows of this rank alone (not under TP)

    def __init__(self, model, plan, *, cache_bytes: int, block_size: int, num_slots: int, max_model_len: int,
                 kv_dtype: str = "float32", state_dtype: str = "float32", conv_dtype: str = "float32",
                 conv_window: str = "kernel", seed: int | None = None, mtp: bool = False):
        """`mtp`: the pools hold the MTP head's KV too (after the decoder's layers), and each step keeps
        the target's hidden states for it (`SampleOutput.hidden`: kvstate.engine.speculative.mtp)."""
        self.model, self.plan, self.block_size, self.mtp = model, plan, block_size, mtp
        self.cache_spec = cache_spec(plan, kv_dtype=kv_dtype, state_dtype=state_dtype, conv_dtype=conv_dtype,
                                     conv_window=conv_window, mtp=mtp)
        self.sizes = pool_sizes(self.cache_spec, cache_bytes, block_size=block_size, num_slots=num_slots,
                                max_model_len=max_model_len)
        self.caches: list[LayerCache] = allocate_pools(self.cache_spec, num_blocks=self.sizes.num_blocks,
                                                       block_size=block_size, num_slots=num_slots, device=model.device)
        # sampling state: seeded requests' generators by request id; the others share `generator`
        self.generators = RequestGenerators(model.device)
        self.generator = None if seed is None else torch.Generator(model.device).manual_seed(seed)
        self.rollback: Batch | None = None  # the last step's verify states, until `keep` picks one
        # decode steps: small ops on one thread, weight streaming and state workers on all (kernels.threads)
        self.serial_small_ops = True
        self.keep_hidden = mtp
        self.hidden: StepHidden | None = None  # the last step's, with keep_hidden
        # with keep_hidden: per state slot, the hidden state of the last token folded into its state
        # (copied with the slot), so a request resuming from a snapshot has h_{p-1} for the MTP head
        self.slot_hidden: torch.Tensor | None = None  # [num_slots, H]

    @property
    def pool_bytes(self) -> dict[str, int]:
        """Bytes the pools hold: {"kv": ..., "state": ...} (state = recurrent + conv)."""
        kv = sum(c.nbytes(("k", "v", "latent")) for c in self.caches)
        state = sum(c.nbytes(("state", "conv")) for c in self.caches)
        return {"kv": kv, "state": state}

    @torch.inference_mode()
    def copy_slots(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole state slots (src -> dst) in every linear layer."""
        for src, dst in copies:
            for c in self.caches:
                for t in (c.state, c.conv):
                    if t is not None:
                        t[dst].copy_(t[src])
            if self.slot_hidden is not None:
                self.slot_hidden[dst].copy_(self.slot_hidden[src])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (src -> dst) in every attention layer (copy-on-write of a cached partial block)."""
        for src, dst in copies:
            for c in self.caches:
                for t in (c.k, c.v, c.latent):
                    if t is not None:
                        t[dst].copy_(t[src])

    @torch.inference_mode()
    def run(self, layout: BatchLayout, input_ids: list[int], *, hidden: bool = False):
        """Run one step's forward over its packed `input_ids`; returns logits [len(layout.sample_rows), vocab] (fp32),
        and with `hidden` also every token's normed last hidden state [T, hidden] (prompt logprobs score them)."""
        device = self.model.device
        batch = Batch.from_layout(layout, device=device)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
        one_query_per_row = batch.decode_only or batch.verify_group is not None  # decode, or verify drafts
        with small_ops_serial() if one_query_per_row and self.serial_small_ops else contextlib.nullcontext():
            normed = None
            if self.keep_hidden or hidden:
                logits, normed = self.model(ids, batch, self.caches, hidden=True)
                if self.keep_hidden:
                    self._keep_slot_hidden(normed, batch)
                    self.hidden = StepHidden(normed, batch, {})
            else:  # only the sampled entries' rows reach the LM head
                logits = self.model(ids, batch, self.caches)
        self.rollback = batch if batch.rollback else None
        return (logits, normed) if hidden else logits

    @torch.inference_mode()
    def keep(self, kept: dict[int, int]) -> None:
        """After postprocess: each verify entry's linear layers keep the state after the tokens it
        kept (`kept`: entry -> tokens, from postprocess), not after all its drafts (speculative
        decoding's rollback)."""
        if self.rollback is not None:
            keep_states(self.rollback, kept)
            self.rollback = None
        if self.slot_hidden is not None and kept and self.hidden is not None:
            offsets, slots = self.hidden.batch.token_offsets, self.hidden.batch.state_slots
            for i, k in kept.items():
                self.slot_hidden[slots[i]].copy_(self.hidden.states[offsets[i] + k - 1])

    def _keep_slot_hidden(self, hidden: torch.Tensor, batch: Batch) -> None:
        """Each entry's slot: the hidden state of its last token; each capture's slot: of its k-th token."""
        if self.slot_hidden is None:
            self.slot_hidden = hidden.new_zeros(self.sizes.num_slots, hidden.shape[-1])
        last = torch.tensor(batch.token_offsets[1:], device=hidden.device) - 1
        self.slot_hidden.index_copy_(0, batch.state_slots, hidden.index_select(0, last))
        for e, caps in batch.captures.items():
            for k, slot in caps:
                self.slot_hidden[slot].copy_(hidden[batch.token_offsets[e] + k - 1])

    @timed("runner")
    def execute(self, step) -> SampleOutput:
        """One scheduled step: drop the sampling state of finished requests, carry out the state-slot
        copies, run the forward, and sample one token per entry that caught up (`step.sample_indices`)."""
        self.generators.drop(step.finished_request_ids)
        self.copy_slots(step.slot_copies)
        self.copy_blocks(step.block_copies)
        # h_{p-1} of the entries resuming from a snapshot, before the forward overwrites their slots
        resumed = {} if self.slot_hidden is None else \
            {i: self.slot_hidden[step.state_slots[i]].clone() for i in step.resumed}
        self.hidden = None
        if step.is_empty:
            return SampleOutput([], [], [])
        scoring = bool(step.prompt_rows())  # entries scoring prompt tokens (prompt_logprobs) need every row
        logits = self.run(batch_layout(step), step.input_ids(), hidden=scoring)
        scored = []
        if scoring:
            logits, normed = logits
            scored = step_prompt_logprobs(self.model.lm_head, normed, step)
        out = self._sample(step, logits)
        out.prompt_logprobs = scored
        if self.hidden is not None:
            self.hidden.resumed = resumed
            out.hidden = self.hidden
        return out

    def _sample(self, step, logits: torch.Tensor) -> SampleOutput:
        seqs, params = step.sample_seqs(), step.sample_params()
        history = None
        if any(p.penalties for p in params):
            history = ([s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs])
        gens = self.generators.get([s.request_id for s in seqs], params)
        if step.drafts:  # speculative decoding: a verify entry has a row per draft and one more
            drafts = [step.drafts.get(i, []) for i in step.sample_indices]
            return sample_step(logits, drafts, params, gens, generator=self.generator, history=history)
        return sample(logits, params, gens, generator=self.generator, history=history)
