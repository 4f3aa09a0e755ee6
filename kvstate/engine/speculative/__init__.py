"""Speculative decoding: drafters propose k tokens, one forward verifies them, rejection sampling
keeps the target distribution, and the linear layers roll back to the accepted length.

    drafter.py     the Drafter protocol (propose, release, after_step) and the StepResult it sees  no torch
    config.py      SpeculativeConfig from vLLM's dict ({"method": "ngram" | "mtp", ...} or {"model": PATH})  no torch
    ngram.py       prompt lookup: the continuation of the latest earlier match of the last n tokens      no torch
    proposer.py    which requests get drafts and how many (limits, eligible params), per step            no torch
    draft_model.py a smaller checkpoint of the same vocabulary, with its own pools and rollback
    mtp.py         the checkpoint's own MTP head: its KV in the engine's pools, rewritten after each verify

The engine side: the scheduler turns a decode into a "verify" entry (last token + drafts), the
runner samples it with `rejection.verify` (kvstate/engine/rejection.py, beside the sampler), the
scheduler appends the accepted tokens and trims the KV blocks past them, and the runner keeps the
linear layers' state at the accepted length (`kvstate.layers.recurrence.keep_states`).
"""

from kvstate.engine.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
