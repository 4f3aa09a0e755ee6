"""`LLM`: the offline engine API, named as in vLLM.

    from kvstate import LLM, SamplingParams
    llm = LLM("path/to/checkpoint", cache_memory="4GiB")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))

One engine step is: schedule (torch-free), run the model on the packed batch, sample, and
postprocess (append tokens, stop conditions, free blocks and slots). Requests that arrive while
others run join the next step (continuous batching); long prompts are prefilled in chunks.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Iterator, Sequence as Seq

from kvstate.engine.outputs import RequestOutput, StreamEvent
from kvstate.engine.params import SamplingParams
from kvstate.engine.scheduler import Scheduler, SchedulerConfig
from kvstate.engine.sequence import Sequence
from kvstate.errors import KvstateError

DEFAULT_CACHE_FRACTION = 0.2  # of the memory available when no --cache-memory is given


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


class LLM:
    def __init__(self, model: str | os.PathLike, *, cache_memory: int | str | None = None, block_size: int = 16,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 conv_window: str = "kernel", seed: int | None = None, load_progress=None):
        import torch

        from kvstate.engine.runner import ModelRunner
        from kvstate.memory import parse_size
        from kvstate.models.loader import load_model

        path = Path(model)
        self.model, self.plan = load_model(path, progress=load_progress)  # progress(bytes_done, total): a bar
        self.tokenizer = None
        if (path / "tokenizer.json").exists():
            from kvstate.models.tokenizer import Tokenizer

            self.tokenizer = Tokenizer(path)
        limit = self.plan.max_position_embeddings or 1 << 20
        max_model_len = min(max_model_len or limit, limit)
        if isinstance(cache_memory, str):
            cache_memory = parse_size(cache_memory, "--cache-memory")
        if cache_memory is None:
            from kvstate.cache.spec import cache_spec

            spec = cache_spec(self.plan, kv_dtype="float32", state_dtype="float32", conv_dtype="float32")
            need = max_num_seqs * (spec.state_bytes + max_model_len * spec.kv_bytes_per_token)
            cache_memory = min(int(DEFAULT_CACHE_FRACTION * available_memory()), need)
        self.runner = ModelRunner(self.model, self.plan, cache_bytes=cache_memory, block_size=block_size,
                                  num_slots=max_num_seqs, max_model_len=max_model_len, conv_window=conv_window)
        sizes = self.runner.sizes
        self.max_model_len = min(max_model_len, sizes.num_blocks * block_size)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else set()
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=sizes.num_blocks, block_size=block_size, num_slots=sizes.num_slots,
            max_model_len=self.max_model_len, vocab_size=self.plan.vocab_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, eos_token_ids=frozenset(eos)),
            detokenize=self.tokenizer.decode if self.tokenizer else None)
        self._generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self._ids = itertools.count()
        self.peak_cache_bytes = {"kv": 0, "state": 0}

    def cache_bytes_in_use(self) -> dict[str, int]:
        """Bytes of the pools owned by running sequences now: KV blocks and state slots apart."""
        sizes = self.runner.sizes
        used_slots = sizes.num_slots - self.scheduler.slots.num_free_slots
        return {"kv": self.scheduler.blocks.num_used_blocks * sizes.block_bytes,
                "state": used_slots * sizes.slot_bytes}

    # -- requests -------------------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise KvstateError("this checkpoint has no tokenizer.json: give prompts as lists of token ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def _add(self, prompts, params) -> list[tuple[str | None, Sequence]]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise KvstateError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        added = []
        for prompt, p in zip(prompts, params):
            text, ids = self._prompt_ids(prompt)
            added.append((text, self.scheduler.add(next(self._ids), ids, p or SamplingParams())))
        return added

    def add_request(self, prompt, params: SamplingParams | None = None) -> Sequence:
        """Queue one request; it joins the running batch at the next step."""
        return self._add([prompt], [params])[0][1]

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences that finished (or were rejected) in it."""
        from kvstate.engine.sampling import request_generators, sample

        plan = self.scheduler.schedule()
        self.runner.copy_slots(self.scheduler.slots.take_copies())
        if plan.is_empty:
            if not self.scheduler.running and self.scheduler.waiting:
                raise KvstateError("the cache pools cannot hold the next waiting request (raise --cache-memory)")
            return self.scheduler.postprocess(plan, [])
        logits = self.runner.run(plan)
        for key, used in self.cache_bytes_in_use().items():
            self.peak_cache_bytes[key] = max(self.peak_cache_bytes[key], used)
        seqs = plan.sample_seqs()
        out = sample(logits, plan.sample_params(), request_generators(seqs), generator=self._generator)
        want = any(s.params.logprobs is not None for s in seqs)
        logprobs = list(zip(out.logprobs, out.top_logprobs)) if want else None
        return self.scheduler.postprocess(plan, out.token_ids, logprobs)

    def _output(self, text: str | None, seq: Sequence) -> RequestOutput:
        decoded = seq.output_text
        if decoded is None:
            decoded = self.tokenizer.decode(seq.output_token_ids) if self.tokenizer else ""
        return RequestOutput(request_id=seq.request_id, prompt=text, prompt_token_ids=seq.prompt_token_ids,
                             token_ids=list(seq.output_token_ids), text=decoded, finish_reason=seq.finish_reason,
                             stop_reason=seq.stop_reason, error=seq.error,
                             logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                             metrics=seq.metrics())

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in the order given."""
        events = self._events(prompts, sampling_params, text_deltas=False)
        return [event.output for event in events if event.finished]

    def stream(self, prompts, sampling_params=None) -> Iterator[StreamEvent]:
        """Yield every new token of every request as it comes; each request's last event carries its output.

        The final outputs come in prompt order (a request finishing early waits for those before it).
        """
        return self._events(prompts, sampling_params, text_deltas=True)

    def _events(self, prompts, sampling_params, *, text_deltas: bool) -> Iterator[StreamEvent]:
        """The event loop behind stream and generate; `text_deltas` decodes each new token's text
        (generate skips it: the whole output is decoded once at the end)."""
        added = self._add(prompts, sampling_params)
        index = {id(seq): i for i, (_, seq) in enumerate(added)}
        seen = [0] * len(added)
        texts = [""] * len(added)
        outputs: dict[int, RequestOutput] = {}
        next_out = 0
        while next_out < len(added):
            finished = self.step() if self.scheduler.has_work() else []
            for text, seq in added:
                i = index[id(seq)]
                for token in seq.output_token_ids[seen[i]:]:
                    seen[i] += 1
                    delta = ""
                    if text_deltas and self.tokenizer is not None:
                        full = self.tokenizer.decode(seq.output_token_ids[: seen[i]])
                        if not full.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                            delta, texts[i] = full[len(texts[i]):], full
                    yield StreamEvent(i, token, delta, False)
            for seq in finished:
                if id(seq) in index:
                    outputs[index[id(seq)]] = self._output(added[index[id(seq)]][0], seq)
            while next_out in outputs:
                out = outputs.pop(next_out)
                yield StreamEvent(next_out, None, "", True, out)
                next_out += 1
