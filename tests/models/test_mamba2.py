"""Pure Mamba-2 (backbone.* checkpoints) equal to transformers, and the Mamba2 layer's state carry.

The tiny checkpoints are transformers' Mamba2ForCausalLM with weights redrawn at unit scale (its
default init leaves the mixers too quiet for a wrong detail to move the logits past the tolerance;
`redraw_weights` draws dt_bias in U(-2, 0), far from the time-step clamps).
"""

import json
import math

import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM

from kvstate.config.fields import ConfigView
from kvstate.errors import KvstateError
from kvstate.families.mamba2 import dt_limit
from kvstate.models.batch import Batch
from kvstate.models.generate import contiguous_caches, forward_logits
from tests.models.checks import (check_all, check_full_forward, check_load_fails, check_saved_loads_in_transformers,
                                 hf_logits, random_ids, redraw_weights, rel_err, save_and_load)

VOCAB = 101
# awkward on purpose: 4 heads of 48 in 2 groups (grouped B/C), conv kernel 3, d_state 16
BASE = dict(vocab_size=VOCAB, hidden_size=96, expand=2, num_heads=4, head_dim=48, n_groups=2, state_size=16,
            conv_kernel=3, num_hidden_layers=3, chunk_size=16)


def tiny(seed: int = 0, **extra) -> Mamba2ForCausalLM:
    torch.manual_seed(seed)
    hf = Mamba2ForCausalLM(Mamba2Config(**{**BASE, **extra})).eval()
    redraw_weights(hf, seed)
    return hf


def test_mamba2_matches_transformers(tmp_path):
    hf = tiny()
    model, plan = save_and_load(hf, tmp_path)
    assert plan.layer_string == "MMM"
    assert plan.params.total == sum(p.numel() for p in hf.parameters())
    check_all(model, hf, VOCAB)


def test_mamba2_time_step_limit_tied_embeddings_and_saving(tmp_path):
    """A finite time_step_limit clamps dt in the scan (it must change the logits here), the LM head
    tied to the embedding, projection biases but no conv bias, and kvstate's saved checkpoint loads
    back in transformers."""
    hf = tiny(1, time_step_limit=(0.0, 0.3), tie_word_embeddings=True, use_bias=True, use_conv_bias=False)
    model, plan = save_and_load(hf, tmp_path / "orig")
    assert plan.params.total == sum(p.numel() for p in hf.parameters())
    assert plan.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight
    assert model.layers[0].mixer.dt_limit == (0.0, 0.3)
    check_full_forward(model, hf, VOCAB)
    ids = random_ids(VOCAB, 40, 7)
    clamped = hf_logits(hf, ids)
    for block in hf.backbone.layers:
        block.mixer.time_step_limit = (0.0, math.inf)
    assert rel_err(hf_logits(hf, ids), clamped) > 1e-3  # the limit matters for this model
    for block in hf.backbone.layers:
        block.mixer.time_step_limit = (0.0, 0.3)
    check_saved_loads_in_transformers(model, plan, hf, tmp_path, VOCAB)


@torch.inference_mode()
def test_packed_chunked_steps_carry_each_sequences_state(tmp_path):
    """Three sequences advance together in packed steps of uneven pieces (a one-token piece among
    longer ones, then a pure decode step); every row equals the sequence run alone in one go."""
    model, _ = save_and_load(tiny(2), tmp_path)
    pieces = [[9, 3, 20], [1, 7, 15], [1, 1, 1], [5, 1, 2]]
    seqs = [random_ids(VOCAB, sum(p[i] for p in pieces), 20 + i) for i in range(3)]
    alone = [forward_logits(model, [s])[0] for s in seqs]
    max_len = max(len(s) for s in seqs)
    caches = contiguous_caches(model, 3, max_len)
    done = [0, 0, 0]
    for step in pieces:
        batch = Batch.build(step, list(done), [2, 0, 1], [[2], [0], [1]], max_len, logits="all")
        # slots deliberately permuted: sequence i lives in slot [2, 0, 1][i]
        ids = [t for i, n in enumerate(step) for t in seqs[i][done[i]: done[i] + n]]
        rows = model(torch.tensor(ids), batch, caches).split(step)
        for i, n in enumerate(step):
            assert rel_err(rows[i], alone[i][done[i]: done[i] + n]) <= 1e-4, (step, i)
            done[i] += n


def test_time_step_limit_spellings():
    def limit(value):
        return dt_limit(ConfigView({"time_step_limit": value}, "cfg.json"))

    assert limit([0.0, {"__float__": "Infinity"}]) == (0.0, math.inf)  # transformers' JSON encoding
    assert limit([0.001, "Infinity"]) == (0.001, math.inf)
    assert limit(json.loads("[0.0, Infinity]")) == (0.0, math.inf)
    assert dt_limit(ConfigView({}, "cfg.json")) == (0.0, math.inf)
    for bad in ([0.0], [0.0, "lots"], "0.1", [True, 1.0]):
        with pytest.raises(KvstateError, match="time_step_limit"):
            limit(bad)


def test_missing_tensor_is_named(tmp_path):
    tiny().save_pretrained(tmp_path)
    check_load_fails(tmp_path, lambda t: t.pop("backbone.layers.1.mixer.conv1d.bias"),
                     r"missing tensors for layers\.1\.mixer\.conv_bias")


def test_wrong_shape_is_named(tmp_path):
    tiny().save_pretrained(tmp_path)
    key = "backbone.layers.2.mixer.in_proj.weight"
    check_load_fails(tmp_path, lambda t: t.__setitem__(key, t[key][:-4].contiguous()),
                     r"backbone\.layers\.2\.mixer\.in_proj\.weight.*shape")


def test_unknown_tensor_is_named(tmp_path):
    tiny().save_pretrained(tmp_path)
    check_load_fails(tmp_path, lambda t: t.__setitem__("backbone.layers.7.mixer.D", torch.zeros(4)),
                     r"backbone\.layers\.7\.mixer\.D")
