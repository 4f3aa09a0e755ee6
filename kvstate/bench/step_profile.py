"""Where a decode step's time goes: weight streaming (the linear kernels) vs everything else.

`profile_decode(llm, prompt, steps)` drives the engine core one step at a time on one request
(or several: a batch) and times, by wall clock, each named part of the step:
- `linear`: every `kernels.linear` call (the projections, the LM head): the weight streaming;
- `recurrent`: the decode form of the recurrences (state read, update, write); with the fused
  Gated DeltaNet kernel (`kernels.decode.gdn_decode`) also that layer's conv, gates and output norm;
- `conv`: the short-conv window update; `attention`: KV writes and paged attention (with the fused
  kernel, `kernels.decode.attention_decode`, also q/k norms, rotary and the output gate);
- `norm`: RMSNorm (and its kernel with the residual add fused in) / gated RMSNorm; `rotary`;
  `sampling`: the runner's sampler;
- `model other`: the rest of the model forward (gates, residual adds, views, embedding, Python);
- `runner other`: building the packed Batch and the input tensors, slot copies;
- `engine other`: scheduling and postprocessing (torch-free Python).
The parts are the regions the code marks with `kvstate.profiling.timed` (free while no profile
collects; ~0.2 us per call while one does, against steps of milliseconds). The parts do not nest.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

from kvstate import profiling

PARTS = ("linear", "recurrent", "conv", "attention", "norm", "rotary", "compiled blocks", "model other", "sampling",
         "runner other", "engine other")
_INNER = ("linear", "recurrent", "conv", "attention", "norm", "rotary", "compiled blocks")


def profile_decode(llm, prompts: list[list[int]], steps: int, per_op: bool = False) -> dict:
    """Run prefill, then `steps` decode steps of the prompts (one batch) timing each part;
    returns {"step_s": mean seconds per step, "batch": sequences every step decoded,
    "parts": {part: mean seconds per step}}.
    per_op: every block op by op (`decode_blocks.per_op`), not as compiled blocks."""
    from kvstate.models.decode_blocks import per_op as op_by_op

    with op_by_op() if per_op else contextlib.nullcontext():
        return _profile(llm, prompts, steps)


def _profile(llm, prompts: list[list[int]], steps: int) -> dict:
    from kvstate.engine.params import SamplingParams

    core = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(f"profile-{i}", prompt, params)
    core.step()  # prefill and the first token, not timed
    raw: dict[str, float] = defaultdict(float)
    total = 0.0
    with profiling.collect(raw):
        for _ in range(steps):
            t0 = time.perf_counter()
            core.step()
            total += time.perf_counter() - t0
            _check_decode(core.last_step, len(prompts))
    while core.has_unfinished():
        core.step()
    inner = sum(raw[p] for p in _INNER)
    parts = {p: raw[p] for p in (*_INNER, "sampling")}
    parts["model other"] = raw["model"] - inner
    parts["runner other"] = raw["runner"] - raw["model"] - raw["sampling"]
    parts["engine other"] = total - raw["runner"]
    return dict(step_s=total / steps, batch=len(prompts), parts={p: parts[p] / steps for p in PARTS})


def _check_decode(step, batch: int) -> None:
    """A timed step must decode one token of each of the batch's sequences: an engine with fewer
    sequence slots (max_num_seqs), or a token budget that chunks the prompts, would time another batch."""
    from kvstate.errors import KvstateError

    if step.num_tokens != [1] * batch:
        raise KvstateError(f"a profiled step computed {step.total_tokens} tokens of {len(step)} sequences, not one of "
                           f"each of {batch}: the engine's max_num_seqs or max_num_batched_tokens is too small")


def profile_table(profiles: dict, weight_bytes: int):
    """A rich table: per part, ms per step and % of the step, one column pair per profile (keyed by
    its batch size, e.g. "8", or "8 per-op"); the last row gives the linear kernels' GB/s of weights
    (measurable on the per-op path only: compiled blocks stream inside their call)."""
    from rich.table import Table

    table = Table(title="decode step breakdown (wall clock per step)")
    table.add_column("part")
    for b in profiles:
        table.add_column(f"b={b} ms", justify="right")
        table.add_column(f"b={b} %", justify="right")
    for part in (*PARTS, "step"):
        cells = []
        for p in profiles.values():
            t = p["step_s"] if part == "step" else p["parts"][part]
            cells += [f"{1e3 * t:.2f}", f"{100 * t / p['step_s']:.0f}%"]
        table.add_row(part, *cells)
    gbps = []
    for p in profiles.values():
        streamed = p["parts"]["compiled blocks"] == 0 and p["parts"]["linear"] > 0
        gbps += [f"{weight_bytes / p['parts']['linear'] / 1e9:.1f} GB/s" if streamed else "-", ""]
    table.add_row("linear: weights streamed", *gbps)  # the kernels' own rate while they run
    return table
