"""The conv window of kernel - 1 columns (`conv_window="kernel-1"`, as vLLM keeps it) end to end.

The short conv reads the W-1 stored columns plus the new input, in prefill and in decode: the
engine with the smaller window must give exactly the default's greedy tokens, through chunked
prefills, mixed decode + prefill steps and batched decodes, on a Gated DeltaNet and a Mamba-2
checkpoint.
"""

import pytest
import torch

from kvstate import LLM, SamplingParams
from tests.engine.test_engine import tiny_qwen3_5
from tests.models.checks import random_ids
from tests.models.test_mamba2 import tiny as tiny_mamba2

VOCAB = 101
FAMILIES = {"qwen3_5": tiny_qwen3_5, "mamba2": tiny_mamba2}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_kernel_minus_one_window_gives_the_default_greedy_tokens(family, tmp_path):
    FAMILIES[family]().save_pretrained(tmp_path)
    prompts = [random_ids(VOCAB, n, 40 + i) for i, n in enumerate([9, 2, 23, 5, 14])]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens, widths = {}, {}
    for window in ("kernel", "kernel-1"):
        llm = LLM(tmp_path, cache_memory="16MiB", block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                  conv_window=window)
        widths[window] = {c.conv.shape[-1] for c in llm.runner.caches if c.conv is not None}
        with torch.inference_mode():
            tokens[window] = [out.token_ids for out in llm.generate(prompts, greedy)]
    assert len(widths["kernel"]) == 1 and widths["kernel-1"] == {widths["kernel"].pop() - 1}
    assert tokens["kernel-1"] == tokens["kernel"]
