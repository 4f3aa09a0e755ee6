"""The planner refuses sizes no real model has, by field, before it builds anything from them:
10**12 layers, a 10**30 head size, a 100,000-entry layer list (an uploaded config, or
`kvstate memory` on a file); every bundled config still reads."""

import json

import pytest

from kvstate.cli import main
from kvstate.config.reader import bundled_names
from kvstate.families import read_plan
from kvstate.errors import ConfigFieldError

BASE = {"model_type": "qwen3_5_text", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}


@pytest.mark.parametrize("patch, field", [
    ({"num_hidden_layers": 10**12}, "num_hidden_layers"),
    ({"head_dim": 10**30}, "head_dim"),
    ({"vocab_size": 10**12}, "vocab_size"),
    ({"hidden_size": 2**21}, "hidden_size"),
    ({"max_position_embeddings": 10**15}, "max_position_embeddings"),
    ({"layer_types": ["linear_attention"] * 100_000, "num_hidden_layers": None}, "layer_types"),
])
def test_sizes_no_model_has_are_refused_by_field(patch, field):
    config = {k: v for k, v in {**BASE, **patch}.items() if v is not None}
    with pytest.raises(ConfigFieldError, match="at most") as info:
        read_plan(config)
    assert info.value.field == field


def test_the_bundled_configs_are_within_the_bounds():
    assert all(read_plan(name).num_layers for name in bundled_names())


def test_kvstate_memory_says_it_in_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, "num_hidden_layers": 10**12}))
    assert main(["memory", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "num_hidden_layers" in err and "Traceback" not in err
