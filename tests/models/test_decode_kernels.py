"""A tiny Qwen3.5 checkpoint (saved by transformers) decodes the same with the decode-step kernels
(`kernels.decode`: norms, fused Gated DeltaNet) as with everything forced to torch: the same greedy
tokens, and per-step logits within 1e-5 relative, for one sequence and for a batch in scattered
slots; the kernels are checked to have run. (These are the per-op kernels: the compiled blocks,
which call the same kernels in one call per block, are held off here; test_decode_blocks.py.)"""

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from kvstate import kernels
from kvstate.kernels import _ext
from kvstate.models.batch import Batch
from kvstate.models.decode_blocks import per_op
from kvstate.models.generate import contiguous_caches
from tests.greedy import greedy_generate
from tests.kernels.conftest import extension
from tests.kernels.test_decode_gdn import Spy
from tests.models.checks import random_ids, redraw_weights, rel_err, save_and_load
from tests.models.test_qwen3_5 import TEXT, VOCAB


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=96, **TEXT)).eval()
    redraw_weights(hf, 0)
    return save_and_load(hf, tmp_path_factory.mktemp("qwen3_5"))[0]


def test_greedy_tokens_equal(model, monkeypatch):
    ext = extension()
    prompt = random_ids(VOCAB, 9, 3)
    with kernels.backend("torch"):
        ref = greedy_generate(model, prompt, 40)
    calls = []
    monkeypatch.setattr(_ext, "_loaded", {"module": Spy(ext, calls), "reason": None})
    with per_op():
        assert greedy_generate(model, prompt, 40) == ref
    assert calls.count("gdn_decode") == 3 * 39  # three GDN layers, every decode step
    assert "rms_norm" in calls


@torch.inference_mode()
def _decode_logits(model, prompts: list[list[int]], steps: int, slots: list[int]) -> torch.Tensor:
    """Prefill the prompts, then `steps` batched decode steps feeding fixed tokens -> [steps, n, vocab]."""
    n, plen = len(prompts), len(prompts[0])
    max_len = plen + steps
    caches = contiguous_caches(model, max(slots) + 1, max_len)
    tables = [[s] for s in slots]  # KV block = the entry's slot number
    model(torch.tensor([t for p in prompts for t in p]), Batch.build([plen] * n, [0] * n, slots, tables, max_len),
          caches)
    feed = [random_ids(VOCAB, steps, 20 + i) for i in range(n)]
    rows = []
    for s in range(steps):
        batch = Batch.build([1] * n, [plen + s] * n, slots, tables, max_len)
        rows.append(model(torch.tensor([f[s] for f in feed]), batch, caches))
    return torch.stack(rows)


@pytest.mark.parametrize("n", [1, 5])
def test_decode_logits_equal(model, n, monkeypatch):
    ext = extension()
    prompts = [random_ids(VOCAB, 13, 7 + i) for i in range(n)]
    slots = [6, 1, 4, 0, 3][:n]
    with kernels.backend("torch"):
        ref = _decode_logits(model, prompts, 8, slots)
    calls = []
    monkeypatch.setattr(_ext, "_loaded", {"module": Spy(ext, calls), "reason": None})
    with per_op():
        got = _decode_logits(model, prompts, 8, slots)
    assert calls.count("gdn_decode") == 3 * 8
    assert rel_err(got, ref) <= 1e-5, rel_err(got, ref)
