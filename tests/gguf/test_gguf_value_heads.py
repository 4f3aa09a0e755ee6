"""A Qwen3.5 GGUF whose value heads outnumber its key heads: llama.cpp's converter reorders them
(tiled), also along the GDN out projection's columns. Where a value head is narrower than a K-quant
block (Qwen3.5-35B-A3B: heads of 128, Q4_K blocks of 256) the columns cannot move as blocks, so the
projection keeps the file's blocks in the file's order and permutes its input (`Linear.input_perm`):
no bf16 copy, the dequantized model's logits, per op and in the compiled decode blocks alike."""

import pytest
import torch
from gguf import GGMLQuantizationType

from kvstate.models import decode_blocks
from kvstate.models.generate import forward_logits
from kvstate.models.loader import load_model
from tests.gguf.rewrite import rewrite
from tests.kernels.conftest import extension

SEQS = [[5, 17, 42, 99, 250, 3, 7, 8, 120, 77, 64, 31, 2], [11]]


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """(checkpoint, f32 GGUF): 2 key heads, 4 value heads of 64 (out projection K = 256 = one Q4_K block)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from kvstate.bench.llama_cpp import convert
    from tests.gguf.conftest import LLAMA_CPP, VOCAB, _tokenizer
    from tests.models.checks import redraw_weights
    from tests.models.test_qwen3_5 import TEXT

    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"no llama.cpp source tree at {LLAMA_CPP}")
    root = tmp_path_factory.mktemp("heads")
    torch.manual_seed(5)
    cfg = {**TEXT, "vocab_size": VOCAB, "hidden_size": 256, "head_dim": 64, "linear_key_head_dim": 64,
           "linear_value_head_dim": 64}
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=256, **cfg)).eval()
    redraw_weights(hf, 2)
    hf.save_pretrained(root / "ckpt")
    _tokenizer(root / "ckpt")
    return root / "ckpt", convert(LLAMA_CPP, root / "ckpt", "f32", root / "f32.gguf")


def test_q4_k_out_projection_keeps_the_files_blocks_and_permutes_its_input(wide_heads, tmp_path):
    ckpt, f32 = wide_heads
    quant = rewrite(f32, tmp_path / "q4_k.gguf", qtype=GGMLQuantizationType.Q4_K, keep={"token_embd.weight"})
    ref = rewrite(f32, tmp_path / "ref.gguf", qtype=GGMLQuantizationType.Q4_K, keep={"token_embd.weight"},
                  dequantized=True, rounded=())
    model, _ = load_model(quant)
    outs = [b.mixer.out_proj for b in model.layers if hasattr(b.mixer, "in_proj_qkv")]
    assert outs and all(m.weight_format == "Q4_K" and m.input_perm is not None for m in outs)
    assert not any(m.input_perm is not None for b in model.layers for m in b.modules()
                   if getattr(m, "weight_format", None) and m not in outs)
    want, _ = load_model(ref)
    plain, _ = load_model(ckpt)
    for got, w, orig in zip(forward_logits(model, SEQS), forward_logits(want, SEQS), forward_logits(plain, SEQS)):
        assert float((got - w).norm() / w.norm()) <= 1e-5
        assert float((got - orig).norm() / orig.norm()) > 1e-4  # the blocks did change the weights
    # the compiled decode blocks read the permuted input too: per-op logits, bit for bit
    from tests.models.test_decode_blocks import _both

    extension()
    ran = []
    real = decode_blocks.run
    decode_blocks.run = lambda entry, *a: ran.append(entry[0]) or real(entry, *a)
    try:
        ref_steps, got_steps = _both(model, 2)
    finally:
        decode_blocks.run = real
    assert ran.count("gdn") == 6 * len(outs)
    assert torch.equal(got_steps, ref_steps)


def test_q8_0_out_projection_still_moves_its_columns_as_blocks(wide_heads, tmp_path):
    """Heads of 64 are whole Q8_0 blocks: the load reorders them, no permutation at run time."""
    _, f32 = wide_heads
    quant = rewrite(f32, tmp_path / "q8_0.gguf", qtype=GGMLQuantizationType.Q8_0, keep={"token_embd.weight"})
    model, _ = load_model(quant)
    outs = [b.mixer.out_proj for b in model.layers if hasattr(b.mixer, "in_proj_qkv")]
    assert all(m.weight_format == "Q8_0" and m.input_perm is None for m in outs)
