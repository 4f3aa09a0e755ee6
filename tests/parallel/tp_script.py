"""A user program run by torchrun (tests/parallel/test_torchrun.py): LLM(path, tensor_parallel_size=N)
on every rank; rank 0 prints the greedy tokens as JSON, the other ranks serve inside LLM() and exit."""

import json
import sys

import torch

from kvstate import LLM, SamplingParams

torch.set_num_threads(1)
llm = LLM(sys.argv[1], cache_memory="8MiB", max_num_seqs=2, tensor_parallel_size=int(sys.argv[2]))
outs = llm.generate([[5, 9, 13, 27, 31], [40, 41, 42]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print(json.dumps([o.outputs[0].token_ids for o in outs]))
llm.close()
