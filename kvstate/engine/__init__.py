"""The inference engine: requests, KV-block and state-slot bookkeeping, scheduling, sampling.

The control plane here (params, sequence, block_manager, scheduler_output, scheduler,
detokenizer) imports no torch, so it starts instantly and is unit-tested without tensors. The
torch parts (runner, sampling, the engine core) are imported where they are needed, never from
this package's top level.

One engine step (`EngineCore.step`, engine/core.py):

    step = scheduler.schedule()                     # which sequences compute how many tokens
    out = runner.execute(step)                      # slot copies, Batch.from_layout, model, sample
    finished, kept = scheduler.postprocess(step, out.token_ids)
    runner.keep(kept)                               # speculative decoding: roll states back
    -> one EngineOutput per request that changed: new tokens, new text, finished, RequestOutput

`LLM` (kvstate/llm.py) is the user API over it: it routes each output to the request's collector.
"""

from kvstate.engine.block_manager import BlockManager, CacheAccountingError, SlotManager
from kvstate.engine.params import SamplingParams
from kvstate.engine.scheduler import Scheduler, SchedulerConfig
from kvstate.engine.scheduler_output import SchedulerOutput
from kvstate.engine.sequence import Sequence, SequenceStatus

__all__ = ["BlockManager", "CacheAccountingError", "SamplingParams", "Scheduler", "SchedulerConfig",
           "SchedulerOutput", "Sequence", "SequenceStatus", "SlotManager"]
