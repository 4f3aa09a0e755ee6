"""The "verify" mode of the forward (speculative decoding) on the four families' tiny checkpoints.

A verify entry runs the last known token and k drafts in one forward; its logits rows equal a
plain forward of the same tokens, and keeping the state after j of them (`keep_states`) leaves
the cache exactly as if only those j had been computed: the next token's logits match a fresh
prefill of the prompt plus those j tokens. Mixed steps (verify + decode + prefill entries) too.
"""

import pytest
import torch

from kvstate import LLM
from kvstate.layers.recurrence import keep_states
from kvstate.models.batch import Batch
from tests.engine.test_engine import FAMILIES, VOCAB
from tests.models.checks import random_ids


@pytest.fixture(scope="module", params=list(FAMILIES))
def runner(request, tmp_path_factory):
    hf = FAMILIES[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return LLM(path, cache_memory="16MiB", block_size=4, max_num_seqs=4).runner


def forward(runner, entries, modes=None, logits="last"):
    """entries: (tokens, context, slot, blocks) -> logits of the step (every row of verify entries)."""
    ids = torch.tensor([t for e in entries for t in e[0]])
    batch = Batch.build([len(e[0]) for e in entries], [e[1] for e in entries], [e[2] for e in entries],
                        [e[3] for e in entries], runner.block_size, modes=modes, logits=logits)
    with torch.inference_mode():
        return runner.model(ids, batch, runner.caches), batch


@pytest.mark.parametrize("keep", [1, 2, 4])
def test_verify_rows_match_a_plain_forward_and_rollback_is_exact(runner, keep):
    prompt, tail = random_ids(VOCAB, 9, 1), random_ids(VOCAB, 4, 2)  # tail: the last known token + 3 drafts
    other = random_ids(VOCAB, 6, 3)
    a, b, c = [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]  # block tables of 16 tokens
    forward(runner, [(prompt, 0, 0, a), (other[:5], 0, 2, c)])  # slot 0: the prompt; slot 2: another request
    # one step mixing a decode (slot 2), a verify (slot 0) and a fresh prefill (slot 1)
    logits, batch = forward(runner, [(other[5:], 5, 2, c), (tail, 9, 0, a), (prompt + tail, 0, 1, b)],
                            modes=["decode", "verify", "prefill"], logits="all")
    verify_rows, plain_rows = logits[1:5], logits[5 + 9 : 5 + 13]
    torch.testing.assert_close(verify_rows, plain_rows, rtol=1e-4, atol=1e-4)
    keep_states(batch, {1: keep})
    assert batch.rollback == []
    nxt = [7]
    after, _ = forward(runner, [(nxt, 9 + keep, 0, a)])  # decode on the rolled-back state
    fresh, _ = forward(runner, [(prompt + tail[:keep] + nxt, 0, 3, b)])
    torch.testing.assert_close(after, fresh, rtol=1e-4, atol=1e-4)
