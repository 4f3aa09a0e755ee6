"""A checkpoint whose config and tensors disagree fails with a message naming what is wrong."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
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


def _copy_checkpoint(src, dest):
    dest.mkdir()
    for f in [f for f in src.iterdir() if f.is_file()]:
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_broken_safetensors_file_is_one_line_naming_it(ckpt, tmp_path, damage):
    bad = _copy_checkpoint(ckpt, tmp_path / "bad")
    data = (bad / "model.safetensors").read_bytes()
    data = {"truncated": data[: len(data) // 2], "garbage": b"\x00garbage" * 64, "empty": b""}[damage]
    (bad / "model.safetensors").write_bytes(data)
    with pytest.raises(KvstateError, match=r"model\.safetensors: not a valid safetensors file") as info:
        load_model(bad)
    assert "\n" not in str(info.value)


def test_index_naming_a_missing_shard_is_one_line(ckpt, tmp_path):
    bad = _copy_checkpoint(ckpt, tmp_path / "bad")
    (bad / "model.safetensors").rename(bad / "model-00001-of-00002.safetensors")
    names = list(load_file(str(bad / "model-00001-of-00002.safetensors")))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map[names[-1]] = "model-00002-of-00002.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(KvstateError, match=r"index\.json: names shard model-00002-of-00002\.safetensors, "
                                           r"which is not in"):
        load_model(bad)


def test_hidden_size_disagreeing_with_the_weights_names_config_and_field(ckpt, tmp_path):
    bad = _copy_checkpoint(ckpt, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = 64  # the weights have 32 columns
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KvstateError, match=r"config\.json's hidden_size = 64 disagrees with the weights"):
        load_model(bad)


def test_cli_reports_a_broken_checkpoint_in_one_line(ckpt, tmp_path):
    bad = _copy_checkpoint(ckpt, tmp_path / "bad")
    (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:100])
    proc = subprocess.run([sys.executable, "-m", "kvstate", "generate", "--model", str(bad), "hi"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "model.safetensors" in proc.stderr
