"""Weights and state pools on transparent huge pages (`kvstate.kernels.hugepages`): the arena is
2 MiB aligned and zero, it is really backed by huge pages where the OS offers them, moving a
model's matrices changes no number and keeps fused groups, tied tensors and parameters as they
were, and KVSTATE_HUGEPAGES=0 turns it all off."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvstate.cache.pools import allocate_pools
from kvstate.kernels import hugepages
from kvstate.models.generate import forward_logits
from kvstate.models.loader import load_model
from tests.models.checks import redraw_weights

needs_thp = pytest.mark.skipif(hugepages.unavailable_reason() is not None,
                               reason=f"no huge pages here: {hugepages.unavailable_reason()}")


@needs_thp
def test_arena_is_aligned_zero_and_backed_by_huge_pages():
    before = hugepages.huge_bytes()
    a = hugepages.arena(8 << 20)
    assert a.dtype == torch.uint8 and a.numel() == 8 << 20 and a.data_ptr() % hugepages.HUGE == 0
    assert int(a.max()) == 0
    a.fill_(1)  # the pages are taken now
    assert hugepages.huge_bytes() - before >= 4 << 20
    parts = hugepages.zeros([((3, 5), torch.float32), ((7,), torch.bfloat16), ((2, 2, 2), torch.int64)])
    assert [(tuple(t.shape), t.dtype) for t in parts] == [((3, 5), torch.float32), ((7,), torch.bfloat16),
                                                          ((2, 2, 2), torch.int64)]
    assert all(int(t.abs().max()) == 0 and t.is_contiguous() for t in parts)
    parts[0].fill_(2.5)  # slots do not overlap
    assert int(parts[1].abs().max()) == 0 and int(parts[2].abs().max()) == 0


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(hugepages.ENV, "0")
    assert "KVSTATE_HUGEPAGES=0" in hugepages.unavailable_reason()
    assert hugepages.arena(1 << 20) is None and hugepages.zeros([((4,), torch.float32)]) is None


def test_a_bad_setting_is_one_line_at_the_command(monkeypatch, capsys):
    from kvstate.cli import main
    from kvstate.errors import KvstateError

    monkeypatch.setenv(hugepages.ENV, "banana")
    with pytest.raises(KvstateError, match="KVSTATE_HUGEPAGES='banana': expected 1 or 0"):
        hugepages.unavailable_reason()
    assert main(["generate", "hi", "--max-tokens", "1"]) != 0
    err = capsys.readouterr().err
    assert "KVSTATE_HUGEPAGES='banana'" in err and err.count("\n") == 1


@needs_thp
@pytest.mark.parametrize("tied", [False, True])
def test_placing_weights_changes_no_number(tmp_path, tied):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)).eval()
    redraw_weights(hf, 0)
    hf.save_pretrained(tmp_path)
    model, _ = load_model(tmp_path)  # tiny: below MIN_BYTES, nothing moved at load
    ids = list(range(3, 40))
    ref = forward_logits(model, [ids])[0]
    params = dict(model.named_parameters())
    mlp = model.layers[0].ffn
    moved = hugepages.place_weights(model, min_bytes=0)
    assert moved >= sum(p.numel() * p.element_size() for p in model.parameters()) - 4096
    assert dict(model.named_parameters()) == params  # the same Parameter objects, rebound
    group = mlp.gate_proj.fused_group
    assert group.intact() and group.weight.data_ptr() % 4096 == 0
    assert mlp.up_proj.weight.data_ptr() == group.weight.data_ptr() + mlp.gate_proj.weight.numel() * 4
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    assert torch.equal(forward_logits(model, [ids])[0], ref)


@pytest.mark.parametrize("huge", ["1", "0"])
def test_pools_are_the_planned_zero_tensors_either_way(tmp_path, monkeypatch, huge):
    from kvstate.cache.spec import cache_spec
    from kvstate.models.loader import load_model as load
    from tests.models.test_qwen3_5 import TEXT
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=96, **TEXT)).save_pretrained(tmp_path)
    model, plan = load(tmp_path)
    monkeypatch.setenv(hugepages.ENV, huge)
    spec = cache_spec(plan)
    pools = allocate_pools(spec, num_blocks=5, block_size=16, num_slots=3)
    plain = [t for c in pools for t in (c.k, c.v, c.state, c.conv) if t is not None]
    assert sum(c.nbytes() for c in pools) == 5 * 16 * spec.kv_bytes_per_token + 3 * spec.state_bytes
    assert all(int(t.abs().max()) == 0 and t.is_contiguous() for t in plain)
    on_arena = plain[0].data_ptr() % hugepages.HUGE == 0
    assert on_arena == (hugepages.unavailable_reason() is None)


PEAK = """
import resource, torch
from torch import nn
from kvstate.kernels import hugepages
model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(8)])  # 8 x 16 MiB
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
moved = hugepages.place_weights(model, min_bytes=0)
print(moved, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


@needs_thp
def test_placing_weights_never_holds_them_twice():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, check=True).stdout.split()
    moved, grown_kib = int(out[0]), int(out[1])
    assert moved == 8 * (16 << 20)
    assert grown_kib < 48 << 10, f"peak RSS grew {grown_kib} KiB while moving 128 MiB"  # all at once: +128 MiB


@needs_thp
def test_a_tensor_parallel_shard_is_placed_too(tmp_path, monkeypatch):
    # load_shard (each TP rank's loader) puts its fused matrices on huge pages as load_model does
    from kvstate.parallel import model as tp_model
    from kvstate.parallel.comm import TPGroup, free_port
    from tests.parallel.checkpoints import save_tiny

    monkeypatch.setattr(tp_model, "place_weights", lambda m: hugepages.place_weights(m, min_bytes=0))
    model, _ = tp_model.load_shard(save_tiny("qwen3_5", tmp_path / "qwen"), TPGroup(0, 1, free_port(), timeout=30))
    groups = {id(g): g for m in model.modules() if (g := getattr(m, "fused_group", None)) is not None}.values()
    assert groups and all(g.intact() for g in groups)
    # an arena's storage is its whole mapping, whole huge pages
    assert all(g.weight.untyped_storage().nbytes() % hugepages.HUGE == 0 for g in groups)
