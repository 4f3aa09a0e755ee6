"""The config reader and the layer plan: real configs, every family, the traps, every bad input.

Independent references: the layer counts and dims stated in the spec documents and
shared/reference/model-configs.md, and transformers itself (its config classes' own layer
lists and its models' parameter counts on the meta device).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstate.config import (
    BUNDLED,
    AttentionSpec,
    GatedDeltaNetSpec,
    KDASpec,
    Mamba1Spec,
    Mamba2Spec,
    MLASpec,
    load_config,
)
from kvstate.errors import KvstateError
from kvstate.families import read_plan, supported_model_types

ROOT = Path(__file__).resolve().parents[1]


def test_bundled_files_are_exactly_the_listed_names():
    on_disk = sorted(p.stem for p in (ROOT / "kvstate" / "data" / "configs").glob("*.json"))
    assert on_disk == sorted(BUNDLED)
    for name in ("qwen3.5-0.8b", "qwen3-next-80b-a3b", "kimi-linear-48b-a3b", "jamba-v0.1",
                 "nemotron-nano-9b-v2", "llama-3.1-8b"):
        assert name in BUNDLED


def test_qwen3_5_0_8b_plan():
    plan = read_plan("qwen3.5-0.8b")
    assert plan.layer_string == "GGGA" * 6
    assert [i for i, _ in plan.mixers("attention")] == [3, 7, 11, 15, 19, 23]
    assert plan.layers[3].mixers == (AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=256, output_gate=True,
                                                   qk_norm=True),)
    assert plan.layers[0].mixers == (GatedDeltaNetSpec(16, 16, 128, 128, 4),)
    assert (plan.model_type, plan.hidden_size, plan.vocab_size, plan.num_layers) == ("qwen3_5", 1024, 248320, 24)
    assert (plan.dtype, plan.state_dtype, plan.max_position_embeddings) == ("bfloat16", "float32", 262144)
    assert plan.tie_word_embeddings is True  # the outer config's flag
    assert plan.layers[0].ffn.kind == "mlp" and plan.layers[0].ffn.intermediate_size == 3584


# (name, {mixer kind: count}, layer string or None): counts as the spec's hybrid table states them
LAYOUTS = [
    ("llama-3.1-8b", {"attention": 32}, "A" * 32),
    ("qwen3.5-35b-a3b", {"gated_deltanet": 30, "attention": 10}, "GGGA" * 10),
    ("qwen3.5-397b-a17b", {"gated_deltanet": 45, "attention": 15}, "GGGA" * 15),
    ("qwen3-next-80b-a3b", {"gated_deltanet": 36, "attention": 12}, "GGGA" * 12),
    ("kimi-linear-48b-a3b", {"kda": 20, "mla": 7}, "KKKL" * 6 + "KKL"),
    ("jamba-v0.1", {"mamba1": 28, "attention": 4}, "SSSSASSS" * 4),
    ("nemotron-h-8b-base-8k", {"mamba2": 24, "none": 24, "attention": 4},
     "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-".replace("*", "A")),
    ("nemotron-nano-9b-v2", {"mamba2": 27, "none": 25, "attention": 4},
     "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-".replace("*", "A")),
]


@pytest.mark.parametrize("name,counts,layout", LAYOUTS)
def test_bundled_layouts(name, counts, layout):
    plan = read_plan(name)
    assert plan.mixer_counts == counts
    assert plan.layer_string == layout


def test_traps_from_the_reference():
    kimi = read_plan("kimi-linear-48b-a3b")  # 1-indexed [4, 8, ..., 24, 27] -> 0-indexed
    assert [i for i, _ in kimi.mixers("mla")] == [3, 7, 11, 15, 19, 23, 26]
    assert kimi.mixers("mla")[0][1] == MLASpec(32, 512, 128, 64, 128, None)
    assert kimi.mixers("kda")[0][1] == KDASpec(32, 128, 4)  # not the top-level head_dim 72
    assert kimi.max_position_embeddings == 1048576  # model_max_length
    assert [layer.ffn.kind for layer in kimi.layers[:2]] == ["mlp", "moe"]  # first_k_dense_replace 1
    nano = read_plan("nemotron-nano-9b-v2")
    assert nano.mixers("attention")[0][1] == AttentionSpec(40, 8, 128)  # explicit head_dim, not 4480/40
    assert nano.mixers("mamba2")[0][1] == Mamba2Spec(128, 80, 128, 8, 4)
    jamba = read_plan("jamba-v0.1")
    assert jamba.mixers("attention")[0][1] == AttentionSpec(32, 8, 128)  # no head_dim: 4096 / 32
    assert jamba.mixers("mamba1")[0][1] == Mamba1Spec(8192, 16, 4, 256)
    assert [layer.ffn.kind for layer in jamba.layers[:4]] == ["mlp", "moe", "mlp", "moe"]


# ---- transformers as the independent reference ------------------------------------------------

def _hf_layer_words(cfg) -> list[str]:
    """transformers' own per-layer list, as "full" / "linear" / "conv" / "mlp" / "moe" / "hybrid"."""
    from kvstate.families._common import LAYER_TYPE_WORDS

    if cfg.model_type in ("qwen3_5", "qwen3_5_moe"):
        cfg = cfg.text_config
    raw = getattr(cfg, "layers_block_type", None) if cfg.model_type == "falcon_h1" else None
    raw = raw or getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None)
    if raw is None:  # dense families
        return ["full"] * cfg.num_hidden_layers
    return [LAYER_TYPE_WORDS.get(w, w) for w in raw]


_OUR_WORD = {"A": "full", "L": "full", "G": "linear", "K": "linear", "M": "linear", "S": "linear",
             "C": "conv", "H": "hybrid"}


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    import torch

    transformers.logging.set_verbosity_error()
    return transformers, torch


def _meta_params(hf, cfg) -> int:
    transformers, torch = hf
    if cfg.model_type in ("qwen3_5", "qwen3_5_moe"):
        cfg = cfg.text_config
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", supported_model_types())
def test_every_family_matches_transformers_defaults(hf, model_type):
    """transformers' default config, saved as JSON: our layer kinds and parameter count match its own."""
    transformers, _ = hf
    cfg = transformers.AutoConfig.for_model(model_type)
    plan = read_plan(json.loads(cfg.to_json_string()))
    ours = []
    for layer in plan.layers:
        if layer.letter == "-":
            ours.append(layer.ffn.kind)
        else:
            ours.append(_OUR_WORD[layer.letter])
    assert ours == _hf_layer_words(cfg)
    assert plan.params.total == _meta_params(hf, cfg)


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_parameter_counts_match_transformers(hf, name):
    transformers, _ = hf
    data = {k: v for k, v in load_config(name).items() if not k.startswith("_")}
    if "text_config" in data:
        data = {**data["text_config"], "tie_word_embeddings": data.get("tie_word_embeddings", False)}
    cfg = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    assert read_plan(name).params.total == _meta_params(hf, cfg)


# ---- equivalent spellings -----------------------------------------------------------------------

def _layers(data: dict) -> tuple:
    return read_plan(data).layers


def test_nemotron_spellings_agree():
    base = load_config("nemotron-h-8b-base-8k")
    pattern = base["hybrid_override_pattern"]
    words = {"M": "mamba", "*": "attention", "-": "mlp"}
    new_words = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    legacy = {**base, "layers_block_type": [words[c] for c in pattern]}
    new = {**base, "layers_block_type": [new_words[c] for c in pattern]}
    del legacy["hybrid_override_pattern"], new["hybrid_override_pattern"]
    renamed = {k: v for k, v in base.items() if k not in ("ssm_state_size", "n_groups", "conv_kernel")}
    renamed.update(mamba_d_state=128, mamba_n_groups=8, mamba_d_conv=4)
    assert _layers(legacy) == _layers(new) == _layers(renamed) == _layers(base)


def test_qwen_interval_equals_layer_types_and_nesting_is_transparent():
    nxt = load_config("qwen3-next-80b-a3b")
    explicit = {**nxt, "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(48)]}
    assert _layers(explicit) == _layers(nxt)
    nested = load_config("qwen3.5-0.8b")
    flat = {**nested["text_config"], "tie_word_embeddings": True}
    a, b = read_plan(nested), read_plan(flat)
    assert (a.layers, a.dtype, a.params) == (b.layers, b.dtype, b.params)
    assert (a.model_type, b.model_type) == ("qwen3_5", "qwen3_5_text")


def test_unknown_fields_are_ignored_and_sources_agree(tmp_path):
    data = load_config("jamba-v0.1")
    noisy = {**data, "some_future_field": {"x": [1, 2]}, "quantization_config": {"bits": 4}}
    assert read_plan(noisy).layers == read_plan(data).layers
    ckpt = tmp_path / "my-jamba"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({k: v for k, v in data.items() if k != "_name_or_path"}))
    from_dir, from_file = read_plan(ckpt), read_plan(ckpt / "config.json")
    assert from_dir == from_file and from_dir.layers == read_plan("jamba-v0.1").layers
    assert from_dir.name == "my-jamba" and read_plan("JAMBA-v0.1").name == "jamba-v0.1"


# ---- bad input: one KvstateError naming the file and the field ----------------------------------

def _broken(tmp_path, name: str, edit) -> Path:
    data = copy.deepcopy(load_config(name))
    edit(data)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def _text(data):
    return data["text_config"]


BAD = [
    ("kimi-linear-48b-a3b", lambda d: d.pop("linear_attn_config"), "linear_attn_config", "missing"),
    ("qwen3.5-0.8b", lambda d: _text(d).update(linear_key_head_dim=0), "text_config.linear_key_head_dim", "positive"),
    ("qwen3.5-0.8b", lambda d: _text(d).update(num_key_value_heads=-2), "num_key_value_heads", "positive"),
    ("qwen3.5-0.8b", lambda d: _text(d).update(head_dim=True), "head_dim", "integer"),
    ("qwen3.5-0.8b", lambda d: _text(d).update(num_hidden_layers=28), "layer_types", "num_hidden_layers is 28"),
    ("qwen3.5-0.8b", lambda d: _text(d)["layer_types"].__setitem__(5, "sliding"), "layer_types", "entry 5"),
    ("qwen3.5-0.8b", lambda d: _text(d).update(mamba_ssm_dtype="float7"), "mamba_ssm_dtype", "unknown dtype"),
    ("qwen3.5-0.8b", lambda d: d.update(text_config=[]), "text_config", "must be an object"),
    ("qwen3-next-80b-a3b", lambda d: d.update(full_attention_interval=0), "full_attention_interval", "positive"),
    ("llama-3.1-8b", lambda d: d.update(model_type="gpt_bigcode"), "model_type", "supported: "),
    ("llama-3.1-8b", lambda d: d.pop("model_type"), "model_type", "missing"),
    ("llama-3.1-8b", lambda d: d.update(hidden_size=4095), "head_dim", "not divisible"),
    ("kimi-linear-48b-a3b", lambda d: d["linear_attn_config"]["full_attn_layers"].__setitem__(6, 28),
     "linear_attn_config.full_attn_layers", "1-indexed"),
    ("kimi-linear-48b-a3b", lambda d: d["linear_attn_config"]["full_attn_layers"].__setitem__(0, 0),
     "linear_attn_config.full_attn_layers", ">= 1"),
    ("kimi-linear-48b-a3b", lambda d: d["linear_attn_config"]["kda_layers"].pop(), "kda_layers", "missing [26]"),
    ("nemotron-nano-9b-v2", lambda d: d.update(hybrid_override_pattern="M-X*"), "hybrid_override_pattern",
     "unknown block letters"),
    ("nemotron-nano-9b-v2", lambda d: d.update(num_hidden_layers=52), "hybrid_override_pattern",
     "num_hidden_layers is 52"),
    ("nemotron-nano-9b-v2", lambda d: d.update(ssm_state_size="big"), "ssm_state_size", "integer"),
    ("jamba-v0.1", lambda d: d.update(attn_layer_offset=8), "attn_layer_offset", "smaller than"),
    ("jamba-v0.1", lambda d: d.update(mamba_d_state=2.5), "mamba_d_state", "integer"),
]


@pytest.mark.parametrize("name,edit,field,message", BAD)
def test_bad_fields_name_the_file_and_the_field(tmp_path, name, edit, field, message):
    path = _broken(tmp_path, name, edit)
    with pytest.raises(KvstateError) as info:
        read_plan(path)
    text = str(info.value)
    assert text.startswith(f"{path}: field '")
    assert field in text and message in text
    assert "\n" not in text


def test_bad_files(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"model_type": "llama",\n "hidden_size": }')
    with pytest.raises(KvstateError, match=r"bad.json: malformed JSON at line 2 column"):
        read_plan(bad_json)
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(KvstateError, match="expected a JSON object"):
        load_config(listing)
    with pytest.raises(KvstateError, match="directory has no config.json"):
        read_plan(tmp_path)
    with pytest.raises(KvstateError, match="not a bundled model .*qwen3.5-0.8b"):
        read_plan(tmp_path / "nope.json")
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(KvstateError, match="bin.json: cannot read"):
        load_config(binary)
    with pytest.raises(KvstateError, match="not a UTF-8 text file .expected a config.json or a checkpoint directory"):
        load_config(binary)


def test_control_plane_imports_no_torch():
    code = (
        "import sys\n"
        "from kvstate.config import BUNDLED\nfrom kvstate.families import read_plan\n"
        "from kvstate.cache import cache_spec\n"
        "import kvstate.memory\n"
        "for n in BUNDLED: cache_spec(read_plan(n))\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy', 'matplotlib') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
