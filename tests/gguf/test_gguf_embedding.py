"""A quantized GGUF's embedding table keeps its blocks (`kernels.Embedding`: a lookup dequantizes only
its rows), and a tied LM head (Qwen3.5-0.8B's: 248k x 1024, the largest matrix a decode step reads)
multiplies by the same blocks rather than a bf16 copy of them: the dequantized model's logits, the
file's bytes held once, per op and through the engine."""

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from kvstate.models.generate import forward_logits
from kvstate.models.loader import load_model
from tests.gguf.rewrite import rewrite

SEQS = [[5, 17, 42, 99, 250, 3, 7, 8, 120, 77, 64, 31, 2], [11]]


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """(checkpoint, f32 GGUF) of a tiny Qwen3.5 whose LM head is its embedding table (no output.weight)."""
    from tests.gguf.conftest import convert_tiny_qwen35

    return convert_tiny_qwen35(tmp_path_factory.mktemp("tied"), 6, tie_word_embeddings=True)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0], ids=lambda q: q.name)
def test_a_tied_head_multiplies_by_the_embedding_tables_blocks(tied, tmp_path, capsys, qtype):
    ckpt, f32 = tied
    assert not any(t.name == "output.weight" for t in GGUFReader(str(f32)).tensors)
    quant = rewrite(f32, tmp_path / "q.gguf", qtype=qtype)
    ref = rewrite(f32, tmp_path / "ref.gguf", qtype=qtype, dequantized=True, rounded=())
    model, _ = load_model(quant)
    assert capsys.readouterr().err == ""  # nothing dequantized
    table = model.embed_tokens
    assert table.weight_format == model.lm_head.weight_format == qtype.name
    assert model.lm_head.weight is table.weight and table.weight.dtype == torch.uint8
    in_file = next(int(t.n_bytes) for t in GGUFReader(str(quant)).tensors if t.name == "token_embd.weight")
    assert table.weight.nbytes == in_file
    want, _ = load_model(ref)
    plain, _ = load_model(ckpt)
    for got, w, orig in zip(forward_logits(model, SEQS), forward_logits(want, SEQS), forward_logits(plain, SEQS)):
        assert float((got - w).norm() / w.norm()) <= 1e-5
        assert float((got - orig).norm() / orig.norm()) > 1e-4
    ids = torch.tensor([[3, 0], [299, 3]])
    assert torch.equal(table(ids), want.embed_tokens(ids).float())  # exact rows, any shape of ids


def test_the_engine_generates_from_a_tied_quantized_file(tied, tmp_path):
    from kvstate.llm import LLM, SamplingParams

    _, f32 = tied
    quant = rewrite(f32, tmp_path / "q.gguf", qtype=GGMLQuantizationType.Q8_0)
    ref = rewrite(f32, tmp_path / "ref.gguf", qtype=GGMLQuantizationType.Q8_0, dequantized=True, rounded=())
    greedy = SamplingParams(max_tokens=6, temperature=0)
    got = LLM(str(quant), max_num_seqs=2).generate([SEQS[0]], greedy)[0].outputs[0].token_ids
    want = LLM(str(ref), max_num_seqs=2).generate([SEQS[0]], greedy)[0].outputs[0].token_ids
    assert got == want and len(got) == 6
