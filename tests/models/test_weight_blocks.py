"""GGML blocks quantized at load (`--weight-dtype q8_0|q4_0|q4_k`, issue 37 part 3): a tiny Qwen3.5
checkpoint whose rows are multiples of 256 loads with its projections as blocks, and its logits equal
those of the fp32 model whose projections hold `gguf.quants.dequantize` of the same blocks (1e-5
relative; prefill and decode-sized inputs), its greedy tokens too. The blocks are the bytes gguf's
own quantizer writes for the checkpoint's weights (Q8_0, Q4_0)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from kvstate.errors import KvstateError
from kvstate.kernels import Linear
from kvstate.models.generate import forward_logits
from tests.greedy import greedy_generate
from kvstate.models.loader import load_model, weight_dtype_of
from tests.models.checks import random_ids, redraw_weights, rel_err

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

VOCAB = 101
# rows of 256 (hidden) and 512 (MLP): every projection fits Q4_K's 256-weight blocks but the GDN
# output projection (its input is 4 value heads x 48 = 192 wide), which stays fp32
CONFIG = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=48,
              layer_types=["linear_attention", "full_attention", "linear_attention"], tie_word_embeddings=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_blocks")
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**CONFIG)).eval()
    redraw_weights(hf, 0)
    hf.save_pretrained(path)
    return path


def _linears(model) -> dict[str, Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_k"])
def test_blocks_equal_the_dequantized_fp32_model(checkpoint, name):
    qtype = name.upper()
    with torch.no_grad():
        model, _ = load_model(checkpoint, weight_dtype=name)
        twin, _ = load_model(checkpoint, weight_dtype="float32")
        ours, ref = _linears(model), _linears(twin)
        blocks = [n for n, m in ours.items() if m.weight_format == qtype]
        kept = sorted(n for n, m in ours.items() if m.weight_format is None)
        if name == "q4_k":  # rows of 192 weights are no multiple of 256
            assert kept and all(n.endswith("out_proj") for n in kept), kept
        else:
            assert kept == [], kept
        assert len(blocks) >= 10 and model.embed_tokens.weight.dtype == torch.float32
        gtype = getattr(gguf.GGMLQuantizationType, qtype)
        for n in blocks:
            raw, w = ours[n].weight, ref[n].weight
            assert raw.dtype == torch.uint8 and ours[n].weight_type.item() == int(gtype)
            if qtype in ("Q8_0", "Q4_0"):  # gguf's own quantizer writes the same bytes
                assert np.array_equal(raw.numpy(), quants.quantize(w.numpy(), gtype))
            ref[n].weight.copy_(torch.from_numpy(quants.dequantize(raw.numpy(), gtype)))
        seqs = [random_ids(VOCAB, 40, 1), random_ids(VOCAB, 6, 2)]
        for a, b in zip(forward_logits(model, seqs), forward_logits(twin, seqs)):
            assert rel_err(a, b) <= 1e-5
        prompt = random_ids(VOCAB, 9, 4)
        assert greedy_generate(model, prompt, 8) == greedy_generate(twin, prompt, 8)
        assert "weight_dtype=" + qtype in repr(model)


def test_block_names_and_where_they_are_refused(checkpoint):
    from kvstate.models.build import set_weight_dtype
    from kvstate.parallel.model import check_weight_dtype

    assert weight_dtype_of("Q4_K") == weight_dtype_of("q4_k") == torch.uint8
    with pytest.raises(KvstateError, match="q4_k weights run in one process"):
        check_weight_dtype("q4_k")
    with pytest.raises(KvstateError, match="q8_0 weights take float32 activations"):
        load_model(checkpoint, dtype=torch.bfloat16, weight_dtype="q8_0")
    with pytest.raises(KvstateError, match="expected bf16, fp32, int8, q8_0, q4_0 or q4_k"):
        weight_dtype_of("q2_k")
    model, _ = load_model(checkpoint, weight_dtype="q4_0")
    with pytest.raises(KvstateError, match="GGML blocks: load the checkpoint again"):
        set_weight_dtype(model, torch.bfloat16)


def test_q8_0_on_the_command_line(capsys):
    import json

    from kvstate.cli import main

    argv = ["bench", "engine", "--quick", "--batches", "1", "--prompt-len", "6", "--new-tokens", "3",
            "--prefill-len", "12", "--json", "--threads", "1", "--no-reference", "--weight-dtype", "Q8_0"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weight_dtype"] == "q8_0"
    assert 0 < out["quant_logit_error"]["rel"] < 0.1 and out["quant_logit_error"]["positions"] == 6
    with pytest.raises(SystemExit) as exit_:  # argparse's one line, exit code 2
        main(["generate", "hi", "--weight-dtype", "q3_k"])
    assert exit_.value.code == 2
    assert "--weight-dtype: expected bf16, fp32, int8, q8_0, q4_0 or q4_k" in capsys.readouterr().err


def test_a_block_that_fits_no_row_is_said_in_one_line(checkpoint, capsys):
    """q4_k's 256-weight blocks do not fit the GDN output projection (rows of 192): it keeps fp32, and the
    load says how many projections were quantized (a model no row of which fits would be all fp32)."""
    model, _ = load_model(checkpoint, weight_dtype="q4_k")
    kept = [n for n, m in _linears(model).items() if m.weight_format is None and n != "lm_head"]
    held = [n for n, m in _linears(model).items() if m.weight_format == "Q4_K"]
    assert kept and all(n.endswith("out_proj") for n in kept)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--weight-dtype q4_k quantized {len(held)} of {len(held) + len(kept)}" in err
    load_model(checkpoint, weight_dtype="q8_0")  # every row fits: nothing to say
    assert capsys.readouterr().err == ""


def test_bench_engine_reports_q8_activations_against_exact_math(capsys):
    """`--activation-dtype q8` on block weights: the logits' distance from the exact mode, as for bf16."""
    import json

    from kvstate.cli import main
    from kvstate.kernels import activation

    if not activation.q8_available():
        pytest.skip("needs the compiled kernels")
    argv = ["bench", "engine", "--quick", "--batches", "1", "--prompt-len", "6", "--new-tokens", "3",
            "--prefill-len", "12", "--json", "--threads", "1", "--no-reference", "--weight-dtype", "q8_0",
            "--activation-dtype", "q8"]
    try:
        assert main(argv) == 0
    finally:
        activation.set_activation_dtype("fp32")
    out = json.loads(capsys.readouterr().out)
    err = out["activation_logit_error"]
    assert out["activation_dtype"] == "q8" and 0 < err["rel"] < 0.2 and err["positions"] == 32
