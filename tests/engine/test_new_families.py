"""The engine on the two families added through the seams: LFM2 (short conv + attention) and Falcon-H1
(attention and Mamba-2 side by side in every block).

Token-exact with transformers' generate() alone and in a batch arriving over time (chunked prefill,
preemption), with prefix caching and with speculation; the pools hold exactly the bytes `kvstate
memory` plans, and the bytes of each family's cache written out here from its transformers config.
The scenarios are the shared ones of the four older families (test_engine, test_prefix_caching,
test_spec), run on these checkpoints.
"""

import json

import pytest

from kvstate import LLM
from kvstate.cli import main
from tests.engine.test_engine import VOCAB, saved
from tests.engine.test_engine import test_arrivals_chunked_prefill_and_preemption_give_exact_greedy_tokens as arrivals
from tests.engine.test_prefix_caching import test_shared_system_prompt_and_branching_conversations as branching
from tests.engine.test_spec import test_prefix_caching_and_speculation_together_stay_exact as prefix_and_speculation
from tests.engine.test_spec import test_speculation_gives_exact_greedy_tokens_under_preemption as speculation
from tests.models.test_falcon_h1 import tiny as tiny_falcon_h1
from tests.models.test_lfm2 import tiny as tiny_lfm2

assert VOCAB == 101  # the tiny checkpoints' vocabulary, which the shared scenarios draw prompts from
FAMILIES = {"lfm2": tiny_lfm2, "falcon_h1": tiny_falcon_h1}
F32 = 4  # bytes


def cache_layout(family: str, cfg) -> tuple[int, int]:
    """(KV bytes per token, state bytes per sequence) in fp32, written out from the transformers config."""
    if family == "lfm2":
        attn = cfg.layer_types.count("full_attention")
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        conv = cfg.hidden_size * cfg.conv_L_cache  # one window over B * x, no recurrent state
        return F32 * attn * 2 * cfg.num_key_value_heads * head_dim, F32 * (cfg.num_hidden_layers - attn) * conv
    layers = cfg.num_hidden_layers  # falcon_h1: every layer holds both caches
    kv = 2 * cfg.num_key_value_heads * cfg.head_dim
    state = cfg.mamba_n_heads * cfg.mamba_d_head * cfg.mamba_d_state
    conv = (cfg.mamba_d_ssm + 2 * cfg.mamba_n_groups * cfg.mamba_d_state) * cfg.mamba_d_conv  # x, B, C
    return F32 * layers * kv, F32 * layers * (state + conv)


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    return saved(FAMILIES, request, tmp_path_factory)


def test_alone_and_batched_over_time_give_transformers_tokens(checkpoint):
    arrivals(checkpoint)


def test_pools_hold_exactly_what_kvstate_memory_plans(checkpoint, capsys):
    path, hf, family = checkpoint
    kv_per_token, state_per_seq = cache_layout(family, hf.config)
    budget, block_size, seqs = 3 * 2**20, 8, 5
    llm = LLM(path, cache_memory=budget, block_size=block_size, max_num_seqs=seqs)
    blocks = (budget - seqs * state_per_seq) // (block_size * kv_per_token)
    assert llm.runner.pool_bytes == {"kv": blocks * block_size * kv_per_token, "state": seqs * state_per_seq}
    assert main(["memory", str(path), "--json", "--kv-dtype", "float32", "--state-dtype", "float32",
                 "--conv-dtype", "float32"]) == 0
    planned = json.loads(capsys.readouterr().out)[0]
    assert (planned["kv_bytes_per_token"], planned["state_bytes"]) == (kv_per_token, state_per_seq)


def test_prefix_caching_resumes_and_stays_exact(checkpoint):
    branching(checkpoint[0])


@pytest.mark.parametrize("drafter", ["noisy", "ngram"])
def test_speculation_stays_exact(checkpoint, drafter):
    speculation(checkpoint[0], drafter)


def test_prefix_caching_with_speculation_stays_exact(checkpoint):
    prefix_and_speculation(checkpoint[0])
