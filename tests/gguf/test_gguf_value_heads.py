"""A Qwen3.5 GGUF whose value heads outnumber its key heads: llama.cpp's converter reorders them
(tiled), also along the GDN out projection's columns. Where a value head is narrower than a K-quant
block (Qwen3.5-35B-A3B: heads of 128, Q4_K blocks of 256) the columns cannot move as blocks, so the
projection keeps the file's blocks in the file's order and permutes its input (`Linear.input_perm`):
no bf16 copy, the dequantized model's logits, per op and in the compiled decode blocks alike."""

import pytest
from gguf import GGMLQuantizationType

from kvstate.models.generate import forward_logits
from kvstate.models.loader import load_model
from tests.gguf.rewrite import rewrite
from tests.kernels.conftest import extension
from tests.models.test_decode_blocks import assert_all_compiled_equal_per_op

SEQS = [[5, 17, 42, 99, 250, 3, 7, 8, 120, 77, 64, 31, 2], [11]]


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """(checkpoint, f32 GGUF): 2 key heads, 4 value heads of 64 (out projection K = 256 = one Q4_K block)."""
    from tests.gguf.conftest import convert_tiny_qwen35

    return convert_tiny_qwen35(tmp_path_factory.mktemp("heads"), 5, intermediate_size=256, hidden_size=256,
                               head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64)


def test_q4_k_out_projection_keeps_the_files_blocks_and_permutes_its_input(wide_heads, tmp_path, monkeypatch):
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
    extension()
    assert_all_compiled_equal_per_op(model, 2, monkeypatch)


def test_q8_0_out_projection_still_moves_its_columns_as_blocks(wide_heads, tmp_path):
    """Heads of 64 are whole Q8_0 blocks: the load reorders them, no permutation at run time."""
    _, f32 = wide_heads
    quant = rewrite(f32, tmp_path / "q8_0.gguf", qtype=GGMLQuantizationType.Q8_0, keep={"token_embd.weight"})
    model, _ = load_model(quant)
    outs = [b.mixer.out_proj for b in model.layers if hasattr(b.mixer, "in_proj_qkv")]
    assert all(m.weight_format == "Q8_0" and m.input_perm is None for m in outs)
