"""A config field transformers fills with a default is read by kvstate with the same default, and
the memory figures (KV and state bytes) never depend on the FFN fields.

transformers (its config classes only, no model) is the independent reference: each scalar field
of real and tiny configs is left out in turn, and kvstate's plan of what is left must equal its
plan of the config transformers completes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstate.cache.spec import cache_spec
from kvstate.config import BUNDLED, load_config
from kvstate.families import read_plan
from kvstate.config.defaults import TABLE, generate
from kvstate.config.fields import ConfigView
from kvstate.errors import KvstateError
from kvstate.families import adapter, supported_model_types
from tests.test_memory import SMALL, TINY

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
ROOT = Path(__file__).resolve().parents[1]
SKIP = {"model_type", "architectures", "auto_map", "_name_or_path", "transformers_version", "torch_dtype", "dtype"}


def _cls(model_type):
    return transformers.CONFIG_MAPPING[model_type]


def _signature(cfg: dict):
    """Everything kvstate derives from a config: layers, FFNs, cache bytes, parameters, model options."""
    plan = read_plan(cfg)
    spec = cache_spec(plan)
    family = adapter(plan.model_type)
    options = family.model_options(ConfigView(plan.config, "<config>")) if hasattr(family, "model_options") else None
    return (plan.layers, plan.hidden_size, plan.vocab_size, plan.max_position_embeddings, plan.tie_word_embeddings,
            plan.params, spec.kv_bytes_per_token, spec.state_bytes, options)


def _configs():
    for name in BUNDLED:
        yield name, load_config(name)
    for model_type, extra in TINY.items():
        yield f"tiny {model_type}", json.loads(transformers.AutoConfig.for_model(model_type, **{**SMALL, **extra})
                                               .to_json_string(), object_hook=_special_float)


def _special_float(obj: dict):
    """transformers writes inf as {"__float__": "Infinity"} (e.g. Mamba-2's time_step_limit), which its
    own config classes refuse to read back: as a float, the config a checkpoint's JSON gives."""
    return float(obj["__float__"]) if obj.keys() == {"__float__"} else obj


def _completed(cfg: dict, path: tuple[str, ...], field: str):
    """transformers' value for `field` left out of the (nested) config at `path`, or None if it has none."""
    inner = cfg
    for p in path:
        inner = inner[p]
    model_type = inner.get("model_type") or "qwen3_5_text"
    try:
        filled = _cls(model_type)(**{k: v for k, v in inner.items() if k not in SKIP}).to_dict()
    except Exception:  # transformers refuses what is left: nothing to compare
        return None
    return filled.get(field)


def _without(cfg: dict, path: tuple[str, ...], field: str, value=None):
    out = json.loads(json.dumps(cfg))
    inner = out
    for p in path:
        inner = inner[p]
    inner.pop(field)
    if value is not None:
        inner[field] = value
    return out


def _fields(cfg: dict):
    for field, value in cfg.items():
        if field not in SKIP and not isinstance(value, (dict, list)) and value is not None:
            yield (), field
    if isinstance(cfg.get("text_config"), dict):
        for field, value in cfg["text_config"].items():
            if field not in SKIP and not isinstance(value, (dict, list)) and value is not None:
                yield ("text_config",), field


@pytest.mark.parametrize("name, cfg", list(_configs()), ids=lambda x: x if isinstance(x, str) else "")
def test_a_field_left_out_is_read_with_transformers_default(name, cfg):
    wrong, checked = [], 0
    for path, field in _fields(cfg):
        value = _completed(_without(cfg, path, field), path, field)
        if value is None or isinstance(value, (dict, list, tuple)):
            continue
        try:
            reference = _signature(_without(cfg, path, field, value))
        except KvstateError:  # the completed config itself is inconsistent (e.g. 8 KV heads for 4 heads)
            continue
        try:
            ours = _signature(_without(cfg, path, field))
        except Exception as exc:  # noqa: BLE001 - a refusal is a failure too
            wrong.append(f"{'.'.join(path + (field,))}: refused ({exc})")
            continue
        checked += 1
        if ours != reference:
            wrong.append(f"{'.'.join(path + (field,))}: read differently than transformers' default {value!r}")
    assert not wrong, "\n".join(wrong)
    assert checked, "no field of this config was compared with transformers' default"


def test_granite_4_h_without_shared_intermediate_size():
    cfg = json.loads(transformers.AutoConfig.for_model("granitemoehybrid", **{**SMALL, **TINY["granitemoehybrid"]})
                     .to_json_string())
    cfg.pop("shared_intermediate_size")
    plan = read_plan(cfg)
    default = _cls("granitemoehybrid")().shared_intermediate_size
    assert {layer.ffn.shared_intermediate_size for layer in plan.layers} == {default}


def test_nemotron_h_without_intermediate_size():
    cfg = json.loads(transformers.AutoConfig.for_model("nemotron_h", **{**SMALL, **TINY["nemotron_h"]})
                     .to_json_string())
    cfg.pop("intermediate_size")
    plan = read_plan(cfg)
    mlp = [layer.ffn for layer in plan.layers if layer.ffn.kind == "mlp"]
    assert mlp and {f.intermediate_size for f in mlp} == {_cls("nemotron_h")().intermediate_size}


FFN_WORDS = ("intermediate", "expert", "moe", "ffn", "mlp", "first_k_dense", "decoder_sparse_step")


def _strip_ffn(cfg: dict) -> dict:
    out = {k: v for k, v in cfg.items() if not any(w in k for w in FFN_WORDS)}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = _strip_ffn(out["text_config"])
    return out


@pytest.mark.parametrize("name", BUNDLED)
def test_memory_figures_do_not_depend_on_ffn_fields(name, tmp_path):
    stripped = _strip_ffn(load_config(name))
    assert stripped != load_config(name) or name == "llama-3.1-8b" and "intermediate_size" not in stripped
    full, bare = cache_spec(read_plan(name)), cache_spec(read_plan(stripped))
    assert (bare.kv_bytes_per_token, bare.recurrent_state_bytes, bare.conv_state_bytes) == \
        (full.kv_bytes_per_token, full.recurrent_state_bytes, full.conv_state_bytes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(stripped))
    proc = subprocess.run([sys.executable, "-m", "kvstate", "memory", "--json", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)[0]["totals"] == {str(c): full.request_bytes(c) for c in (8192, 131072, 262144)}


def test_the_table_is_transformers_own():
    stored = json.loads((ROOT / "kvstate" / "data" / TABLE).read_text())
    assert stored == generate(supported_model_types()), "run: python -m kvstate.families.defaults_table"
