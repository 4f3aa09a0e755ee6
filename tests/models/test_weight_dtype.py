"""bf16-stored weights (issue 9): every family's tiny checkpoint saved in bf16, run with its matrices
kept in bf16 (the default for a bf16 checkpoint) and with them upcast to fp32, gives the same logits
(1e-5 relative: only the summation order differs) and the same greedy tokens, through the kernels
(decode-sized inputs) and torch's GEMM (prefill), and with the torch fallback forced on.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from kvstate import kernels
from kvstate.errors import KvstateError
from kvstate.kernels import Linear
from kvstate.models.generate import forward_logits
from tests.greedy import greedy_generate
from kvstate.models.loader import load_model, weight_dtype_of
from tests.models.checks import random_ids, redraw_weights, rel_err
from tests.models.test_dense import _tiny_llama
from tests.models.test_jamba import tiny as tiny_jamba
from tests.models.test_kimi_linear import make as tiny_kimi
from tests.models.test_mamba2 import tiny as tiny_mamba2
from tests.models.test_nemotron_h import tiny as tiny_nemotron
from tests.models.test_qwen3_5 import tiny_moe as tiny_qwen3_5_moe
from tests.models.test_qwen3_next import tiny as tiny_qwen3_next

VOCAB = 97  # below every tiny model's vocabulary


def _qwen3_5_moe():
    hf = tiny_qwen3_5_moe(0)
    redraw_weights(hf, 0)
    return hf


FAMILIES = {
    "llama": _tiny_llama,
    "qwen3_5_moe": _qwen3_5_moe,  # Gated DeltaNet + gated attention + MoE with a shared expert
    "qwen3_next": lambda: tiny_qwen3_next("moe-mlp-only-layer"),
    "mamba2": tiny_mamba2,
    "kimi_linear": lambda: tiny_kimi("groups-first2dense"),  # KDA + MLA (absorbed decode) + MoE
    "jamba": lambda: tiny_jamba("head32"),  # Mamba-1 + attention + MoE
    "nemotron_h": tiny_nemotron,  # Mamba-2 + attention + MoE (sigmoid router)
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def bf16_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    FAMILIES[request.param]().to(torch.bfloat16).save_pretrained(path)
    return path


def _matrices(model) -> list[torch.Tensor]:
    from kvstate.layers.moe import Experts

    out = [m.weight for m in model.modules() if isinstance(m, Linear)]
    out += [p for m in model.modules() if isinstance(m, Experts) for p in (m.gate_up, m.down)]
    return out + [model.embed_tokens.weight]


def _compare(bf16, fp32):
    seqs = [random_ids(VOCAB, 40, 1), random_ids(VOCAB, 6, 2)]  # 46 rows: torch's GEMM; 6 rows: kernels
    for ours, ref in zip(forward_logits(bf16, seqs), forward_logits(fp32, seqs)):
        assert rel_err(ours, ref) <= 1e-5
    short = [random_ids(VOCAB, 5, 3)]  # every projection on the kernels
    assert rel_err(forward_logits(bf16, short)[0], forward_logits(fp32, short)[0]) <= 1e-5
    prompt = random_ids(VOCAB, 9, 4)
    assert greedy_generate(bf16, prompt, 12) == greedy_generate(fp32, prompt, 12)


@pytest.mark.parametrize("path", ["auto", "torch"])
def test_bf16_weights_equal_the_fp32_upcast(bf16_checkpoint, path):
    with torch.no_grad(), kernels.backend(path):
        bf16, _ = load_model(bf16_checkpoint)  # default for a bf16 checkpoint: matrices kept in bf16
        fp32, _ = load_model(bf16_checkpoint, weight_dtype="float32")
        assert {w.dtype for w in _matrices(bf16)} == {torch.bfloat16}
        assert {w.dtype for w in _matrices(fp32)} == {torch.float32}
        small = [p for n, p in bf16.named_parameters() if "norm" in n or "A_log" in n or "conv" in n]
        assert small and {p.dtype for p in small} == {torch.float32}  # norms, decays, convs stay fp32
        for w, ref in zip(_matrices(bf16), _matrices(fp32)):
            assert torch.equal(w.float(), ref)  # loaded as saved: no rounding, no fp32 detour
        _compare(bf16, fp32)


def test_fp32_checkpoint_defaults_to_fp32_and_takes_bf16(tmp_path):
    _tiny_llama().save_pretrained(tmp_path)
    model, _ = load_model(tmp_path)
    assert {w.dtype for w in _matrices(model)} == {torch.float32}
    model, _ = load_model(tmp_path, weight_dtype="bf16")
    assert {w.dtype for w in _matrices(model)} == {torch.bfloat16}
    if model.lm_head.weight is not model.embed_tokens.weight:
        assert model.lm_head.weight.dtype == torch.bfloat16


def test_weight_dtype_spellings():
    assert weight_dtype_of("bf16") == weight_dtype_of("BFloat16") == weight_dtype_of(torch.bfloat16) == torch.bfloat16
    assert weight_dtype_of("fp32") == weight_dtype_of("float32") == torch.float32
    assert weight_dtype_of(None) is None
    with pytest.raises(KvstateError, match="weight dtype 'fp8'"):
        weight_dtype_of("fp8")


def test_weight_dtype_on_the_command_line(capsys, tmp_path):
    import json

    from kvstate.cli import main

    argv = ["bench", "engine", "--quick", "--batches", "1", "--prompt-len", "6", "--new-tokens", "3",
            "--prefill-len", "12", "--json", "--threads", "1", "--no-reference"]
    assert main(argv + ["--weight-dtype", "bf16"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_dtype"] == "bfloat16"
    with pytest.raises(SystemExit) as exit_:  # argparse's one line, exit code 2
        main(["generate", "hi", "--model", str(tmp_path), "--weight-dtype", "int4"])
    assert exit_.value.code == 2
    assert "--weight-dtype: expected bf16, fp32, int8, q8_0" in capsys.readouterr().err


def test_same_input_projections_run_as_one_call(tmp_path, monkeypatch):
    """GDN's four input projections, q/k/v and gate/up are one kernel call each after loading, with
    the logits of the unfused model; a .to() that moves the weights falls back to separate calls."""
    import kvstate.kernels.fused as fused_mod
    import kvstate.kernels.linear_module as module_mod

    _qwen3_5_moe().save_pretrained(tmp_path)
    model, _ = load_model(tmp_path)
    gdn = model.layers[0].mixer
    group = gdn.in_proj_qkv.fused_group
    assert gdn.in_proj_z.weight.data_ptr() == group.weight.data_ptr() + gdn.in_proj_qkv.weight.numel() * 4
    calls = []
    for mod in (fused_mod, module_mod):
        monkeypatch.setattr(mod, "linear", lambda x, w, *rest, f=mod.linear: calls.append(w.shape) or f(x, w, *rest))
    ids = [random_ids(VOCAB, 3, 5)]
    with torch.no_grad():
        fused = forward_logits(model, ids)[0]
        n_fused = len(calls)
        model.to(torch.float64).to(torch.float32)  # new tensors: the groups are no longer intact
        calls.clear()
        apart = forward_logits(model, ids)[0]
    # 3 GDN layers save 3 calls each, 2 attention layers 2 each, the shared experts' gate/up 1 per layer
    assert len(calls) - n_fused == 3 * 3 + 2 * 2 + 5
    assert rel_err(fused, apart) <= 1e-6
