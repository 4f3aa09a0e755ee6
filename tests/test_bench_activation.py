"""`kvstate bench engine --activation-dtype`: the opt-in bf16 activations run and report their logit
error against exact math; a CPU without AVX512_BF16 gets one clear line (exit 2)."""

import io
import json

import pytest
from rich.console import Console

from kvstate.bench.engine_table import show
from kvstate.cli import main
from kvstate.kernels import activation

ARGS = ["bench", "engine", "--quick", "--no-reference", "--batches", "1", "--prompt-len", "6", "--new-tokens", "4",
        "--prefill-len", "12", "--threads", "1", "--weight-dtype", "bf16"]


@pytest.fixture
def restore():
    yield
    if activation.available():
        activation.set_activation_dtype("fp32")


def test_bf16_activations_report_their_error_against_exact_math(capsys, restore):
    if not activation.available():
        pytest.skip("needs the compiled kernels on a CPU with AVX512_BF16")
    assert main([*ARGS, "--activation-dtype", "bf16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    err = out["activation_logit_error"]
    assert out["activation_dtype"] == "bf16" and err["positions"] == 32
    # rounded, not exact: a real error, of bf16's size (2^-9 per product) on random weights
    assert 0 < err["rel"] < 0.02 and err["top1"] > 0.8
    console = Console(file=io.StringIO(), width=200)
    show(console, out)
    text = console.file.getvalue()
    assert "activations bf16" in text and "bf16 activations vs fp32 math" in text
    assert "32-token prompt (the decode kernels)" in text and "128-token prompt (the prefill GEMMs)" in text


def test_block_weights_report_the_prefill_rows_error(capsys, restore):
    """GGML block weights keep fp32 x in their decode kernels (no error at 32 tokens) and round x to bf16
    in the prefill GEMMs: the 128-token figure is what the opt-in costs them."""
    if not activation.available():
        pytest.skip("needs the compiled kernels on a CPU with AVX512_BF16")
    args = [a if a != "bf16" else "q8_0" for a in ARGS]
    assert main([*args, "--activation-dtype", "bf16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    decode, prefill = out["activation_logit_error"], out["activation_logit_error_prefill"]
    assert decode["positions"] == 32 and prefill["positions"] == 128
    assert decode["rel"] == 0 and 0 < prefill["rel"] < 0.05


def test_without_avx512_bf16_the_opt_in_is_one_line(capsys, monkeypatch, restore):
    monkeypatch.setattr(activation, "available", lambda: False)
    assert main([*ARGS, "--activation-dtype", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "needs the compiled kernels on a CPU with AVX512_BF16" in err and err.count("\n") == 1
