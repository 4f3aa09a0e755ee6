"""The inference engine: requests, KV-block and state-slot bookkeeping, scheduling, sampling.

The control plane here (params, sequence, block_manager, plan, scheduler) imports no torch, so
it starts instantly and is unit-tested without tensors. `kvstate.engine.sampling` (torch) is
imported by the runner where it is needed, never from this package's top level.

One engine step:

    plan = scheduler.schedule()                     # which sequences compute how many tokens
    batch = Batch.build(**plan.batch_args())        # kvstate.models.batch
    logits = model(input_ids, batch, caches)        # input_ids = plan.input_ids()
    out = sample(logits[plan.sample_indices], plan.sample_params(), ...)
    finished = scheduler.postprocess(plan, out.token_ids)
"""

from kvstate.engine.block_manager import BlockManager, CacheAccountingError, SlotManager
from kvstate.engine.params import SamplingParams
from kvstate.engine.plan import StepPlan
from kvstate.engine.scheduler import Scheduler, SchedulerConfig
from kvstate.engine.sequence import Sequence, SequenceStatus

__all__ = ["BlockManager", "CacheAccountingError", "SamplingParams", "Scheduler", "SchedulerConfig",
           "Sequence", "SequenceStatus", "SlotManager", "StepPlan"]
