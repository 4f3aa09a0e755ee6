"""Hub ids resolve through huggingface_hub's cache offline, local paths are used as is, and every
miss is one line (kvstate.hub, the config reader, the loader and the CLI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants, scan_cache_dir

from kvstate.families import read_plan
from kvstate.errors import KvstateError
from kvstate.hub import looks_like_repo_id, resolve_checkpoint, resolve_config
from tests.hub_cache import COMMIT, populate

ROOT = Path(__file__).resolve().parents[1]
QWEN = ROOT / "kvstate" / "data" / "configs" / "qwen3.5-0.8b.json"


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    """An offline hub cache holding org/tiny (config.json and a tokenizer_config.json)."""
    cache = tmp_path / "hub"
    populate(cache, "org/tiny", {"config.json": QWEN.read_bytes(), "tokenizer_config.json": b"{}"})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_the_cache_layout_is_huggingface_hubs_own(hub):
    (repo,) = scan_cache_dir(hub).repos
    assert repo.repo_id == "org/tiny"
    (rev,) = repo.revisions
    assert rev.commit_hash == COMMIT and rev.refs == frozenset({"main"})
    assert {f.file_name for f in rev.files} == {"config.json", "tokenizer_config.json"}


def test_hub_id_resolves_to_the_cached_snapshot(hub):
    snapshot = resolve_checkpoint("org/tiny")
    assert snapshot == hub / "models--org--tiny" / "snapshots" / COMMIT
    assert resolve_config("org/tiny") == snapshot / "config.json"
    plan = read_plan("org/tiny")
    assert plan.name == "org/tiny" and plan.layer_string == read_plan("qwen3.5-0.8b").layer_string


def test_local_paths_are_used_as_is(tmp_path, hub):
    (tmp_path / "org").mkdir()
    local = tmp_path / "org" / "tiny"  # same spelling as the hub id: the existing path wins
    local.mkdir()
    assert resolve_checkpoint(local) == local
    assert resolve_config(QWEN) == QWEN


@pytest.mark.parametrize("name, message", [
    ("org/missing", "org/missing: no such file or directory, and not in the Hugging Face cache (HF_HUB_OFFLINE"),
    ("./no/such/dir", "./no/such/dir: no such file or directory$"),
    ("a/b/c", "a/b/c: no such file or directory$"),
])
def test_misses_are_one_line(hub, name, message):
    with pytest.raises(KvstateError, match=message.replace("(", r"\(")) as info:
        resolve_checkpoint(name)
    assert "\n" not in str(info.value)


def test_a_repo_without_config_is_one_line(hub):
    populate(hub, "org/noconfig", {"README.md": b"hi"})
    with pytest.raises(KvstateError, match="org/noconfig: .*not in the Hugging Face cache"):
        read_plan("org/noconfig")


def test_what_counts_as_a_hub_id():
    assert looks_like_repo_id("Qwen/Qwen3.5-0.8B")
    for text in ("qwen3.5-0.8b", "./a/b", "/abs/x", "a/b/c", "a/config.json", "a--b/c", ""):
        assert not looks_like_repo_id(text), text


def _cli(*argv, cache: Path):
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "kvstate", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


def test_memory_cli_takes_a_hub_id(hub):
    res = _cli("memory", "--json", "org/tiny", cache=hub)
    assert res.returncode == 0, res.stderr
    (obj,) = json.loads(res.stdout)
    assert obj["model"] == "org/tiny"
    res = _cli("memory", "org/absent", cache=hub)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "org/absent" in res.stderr


def test_loader_takes_a_hub_id(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvstate.models.loader import load_model
    from tests.hub_cache import populate_from_dir

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "saved")
    populate_from_dir(tmp_path / "hub", "org/llama-tiny", tmp_path / "saved")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model, plan = load_model("org/llama-tiny")
    local, _ = load_model(tmp_path / "saved")
    assert plan.name == "org/llama-tiny"
    for (name, a), (_, b) in zip(model.state_dict().items(), local.state_dict().items()):
        assert torch.equal(a, b), name
