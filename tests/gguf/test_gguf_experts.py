"""MoE expert tensors of a quantized GGUF ([E, N, K] `*_exps`, most of a Qwen3.5-35B-A3B file's bytes)
stay the file's blocks in the `Experts` parameters: the dequantized model's logits, the blocks' bytes
held rather than a bf16 copy (twice to four times as large), and the load line counts only the routers."""

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from kvstate.layers.moe import Experts
from kvstate.models.generate import forward_logits
from kvstate.models.loader import load_model
from tests.gguf.rewrite import rewrite

SEQS = [[5, 17, 42, 99, 250, 3, 7, 8, 120, 77, 64, 31, 2], [11]]


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0], ids=lambda q: q.name)
def test_expert_tensors_keep_their_blocks(converted, tmp_path, capsys, qtype):
    quant = rewrite(converted["moe"], tmp_path / "q.gguf", qtype=qtype, keep={"token_embd.weight"}, experts=True)
    routers = {t.name for t in GGUFReader(str(converted["moe"])).tensors if t.name.endswith("ffn_gate_inp.weight")}
    # the routers are read as tensors: dequantized at load to bf16, as the reference rounds them
    ref = rewrite(converted["moe"], tmp_path / "ref.gguf", qtype=qtype, keep={"token_embd.weight"}, experts=True,
                  dequantized=True, rounded=routers)
    model, _ = load_model(quant)
    err = capsys.readouterr().err
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all((e.gate_up_format, e.down_format) == (qtype.name,) * 2 for e in experts)
    assert all(e.gate_up.dtype == torch.uint8 and e.down.dtype == torch.uint8 for e in experts)
    in_file = sum(int(t.n_bytes) for t in GGUFReader(str(quant)).tensors if "_exps" in t.name)
    assert sum(e.gate_up.nbytes + e.down.nbytes for e in experts) == in_file
    assert f": {len(routers)} {qtype.name} tensor(s) dequantized" in err  # the routers, not the experts
    want, _ = load_model(ref)
    plain, _ = load_model(converted["ckpt-moe"])
    for got, w, orig in zip(forward_logits(model, SEQS), forward_logits(want, SEQS), forward_logits(plain, SEQS)):
        assert float((got - w).norm() / w.norm()) <= 1e-5
        assert float((got - orig).norm() / orig.norm()) > 1e-4  # the blocks did change the weights


def test_experts_of_a_float_dtype_asked_for_are_dequantized(converted, tmp_path, capsys):
    quant = rewrite(converted["moe"], tmp_path / "q.gguf", qtype=GGMLQuantizationType.Q8_0, experts=True)
    model, _ = load_model(quant, weight_dtype="bf16")
    assert all(e.gate_up_format is None and e.gate_up.dtype == torch.bfloat16
               for e in model.modules() if isinstance(e, Experts))
    assert "Q8_0 tensor(s) dequantized to bfloat16" in capsys.readouterr().err
