"""A checkpoint whose config and tensors disagree fails with a message naming what is wrong."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvstate.errors import KvstateError
from kvstate.models.loader import load_model
from tests.models.checks import check_load_fails


@pytest.fixture()
def ckpt(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    return tmp_path


def test_missing_tensor_is_named(ckpt):
    check_load_fails(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
                     r"missing tensors for layers\.1\.ffn\.up_proj\.weight")


def test_wrong_shape_is_named(ckpt):
    check_load_fails(ckpt, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(8, 32)),
                     r"model\.layers\.0\.self_attn\.k_proj\.weight.*shape \(8, 32\)")


def test_unknown_tensor_is_named(ckpt):
    check_load_fails(ckpt, lambda t: t.__setitem__("model.layers.0.self_attn.rotary.weight", torch.zeros(3)),
                     "rotary.weight")


def test_unsupported_model_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "not_a_model"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KvstateError, match="unsupported model_type 'not_a_model'"):
        load_model(ckpt)


def test_no_weights(tmp_path, ckpt):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((ckpt / "config.json").read_text())
    with pytest.raises(KvstateError, match="no \\*.safetensors"):
        load_model(tmp_path / "empty")
