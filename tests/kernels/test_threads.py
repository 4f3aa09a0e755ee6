"""The decode step's thread policy (kvstate.kernels.threads): small ops on one thread, the weight
streaming kernels and the recurrent forms' workers on all of them; the engine engages it for
decode steps only, with the same greedy tokens."""

import pytest
import torch

from kvstate.kernels import dispatch
from kvstate.kernels.threads import small_ops_serial, wide, wide_threads
from kvstate.ops import _threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_small_ops_serial_and_wide(two_threads):
    assert wide_threads() == 2
    with small_ops_serial():
        assert torch.get_num_threads() == 1 and wide_threads() == 2
        with small_ops_serial():  # nested: no change
            assert torch.get_num_threads() == 1
        with wide():
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with wide():  # outside the serial block: nothing to give back
        assert torch.get_num_threads() == 2


def test_linear_and_state_workers_get_all_threads_back(two_threads, monkeypatch):
    seen = []
    real = dispatch._linear
    monkeypatch.setattr(dispatch, "_linear", lambda *a: (seen.append(torch.get_num_threads()), real(*a))[1])
    x, w = torch.randn(3, 40), torch.randn(24, 40)
    with small_ops_serial():
        y = dispatch.linear(x, w)
        assert torch.get_num_threads() == 1  # back to one after the call
        assert _threads.workers(float(_threads.MIN_WORK), pieces=8) == 2
    assert seen == [2]
    torch.testing.assert_close(y, x @ w.T)


def test_engine_runs_decode_small_ops_on_one_thread(two_threads, monkeypatch, tmp_path):
    from kvstate import LLM, SamplingParams
    from kvstate.layers.norm import RMSNorm
    from tests.engine.test_engine import tiny_qwen3_5

    tiny_qwen3_5().save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_model_len=64)
    threads = []
    forward = RMSNorm.forward
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: (threads.append(torch.get_num_threads()),
                                                             forward(self, x))[1])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    serial = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    # one prefill step, then three decode steps, each with the same norms (the decode steps fewer:
    # the fused attention kernel does q/k's norms itself)
    n_prefill = len(threads) - threads[::-1].index(2)  # the calls up to the prefill's last
    decode = threads[n_prefill:]
    assert set(threads[:n_prefill]) == {2}
    assert decode and len(decode) % 3 == 0 and decode == [1] * len(decode)
    llm.runner.serial_small_ops = False
    threads.clear()
    assert llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids == serial
    assert set(threads) == {2}
