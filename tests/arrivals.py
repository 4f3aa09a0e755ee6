"""Requests that arrive over time: the engine loop the engine tests share (test_engine, test_spec,
test_prefix_caching, parallel/test_engine_tp)."""

from __future__ import annotations


def run_arrivals(core, prompts: list[list[int]], params, *, first: int = 1, every: int = 2, after_step=None,
                 max_steps: int = 100_000) -> tuple[dict, dict]:
    """Step the engine `core` until every prompt finished. Prompt i is request id i: `first` of them
    arrive before the first step, then one more every `every` steps. `after_step(core)` runs after
    each step (pool checks). Returns ({id: RequestOutput}, {id: token ids as streamed})."""
    done: dict = {}
    streamed: dict = {i: [] for i in range(len(prompts))}
    added = step = 0
    while len(done) < len(prompts):
        assert step < max_steps, f"the engine stopped making progress ({len(done)} of {len(prompts)} finished)"
        if added < len(prompts) and step % every == 0:
            upto = min(len(prompts), added + (first if step == 0 else 1))
            for i in range(added, upto):
                core.add_request(i, prompts[i], params)
            added = upto
        for out in core.step():
            streamed[out.request_id] += out.token_ids
            if out.finished:
                done[out.request_id] = out.output
        if after_step is not None:
            after_step(core)
        step += 1
    return done, streamed
