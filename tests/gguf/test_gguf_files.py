"""GGUF files written with gguf's GGUFWriter: quantized matrices load dequantized (logits equal the model
holding gguf's dequantization), and each bad file is one line and exit 2 at the CLI, never a traceback."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from kvstate.cli import main
from kvstate.models.generate import forward_logits
from kvstate.models.loader import load_model
from tests.gguf.rewrite import rewrite

ROOT = Path(__file__).resolve().parents[2]
SEQS = [[5, 17, 42, 99, 250, 3, 7, 8, 120, 77, 64, 31, 2], [11]]


BLOCK_TYPES = [GGMLQuantizationType[q] for q in ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")]


def _block_bytes(model) -> dict[str, int]:
    return {name: m.weight.nbytes for name, m in model.named_modules() if getattr(m, "weight_format", None)}


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_quantized_file_keeps_its_blocks_and_gives_the_dequantized_models_logits(converted, tmp_path, qtype):
    from gguf import GGUFReader

    quant = rewrite(converted["f32"], tmp_path / f"{qtype.name}.gguf", qtype=qtype, keep={"token_embd.weight"})
    ref = rewrite(converted["f32"], tmp_path / "ref.gguf", qtype=qtype, keep={"token_embd.weight"},
                  dequantized=True, rounded=())
    model, _ = load_model(quant)
    want_model, _ = load_model(ref)
    plain, _ = load_model(converted["f32"])
    for got, want, orig in zip(forward_logits(model, SEQS), forward_logits(want_model, SEQS),
                               forward_logits(plain, SEQS)):
        assert float((got - want).norm() / want.norm()) <= 1e-5
        assert float((got - orig).norm() / orig.norm()) > 1e-4  # the quantization did change the weights
    # every quantized matrix is held as the file's blocks: its bytes, not a float copy
    in_file = {t.name: int(t.n_bytes) for t in GGUFReader(str(quant)).tensors if t.tensor_type == qtype}
    held = _block_bytes(model)
    assert len(held) == len(in_file) > 0 and sum(held.values()) == sum(in_file.values())
    assert {m.weight_format for m in model.modules() if getattr(m, "weight_format", None)} == {qtype.name}


def test_nemotron_h_q8_0_file_keeps_blocks_through_the_q_k_permutation(converted, tmp_path):
    """The converter permutes Nemotron-H's q and k rows (for a RoPE it does not have): undone on whole block rows."""
    qtype = GGMLQuantizationType.Q8_0
    quant = rewrite(converted["nemotron_h"], tmp_path / "nh-q8.gguf", qtype=qtype, keep={"token_embd.weight"})
    ref = rewrite(converted["nemotron_h"], tmp_path / "nh-ref.gguf", qtype=qtype, keep={"token_embd.weight"},
                  dequantized=True, rounded=())
    model, _ = load_model(quant)
    want_model, _ = load_model(ref)
    assert model.layers[1].mixer.q_proj.weight_format == "Q8_0"
    for got, want in zip(forward_logits(model, SEQS), forward_logits(want_model, SEQS)):
        assert float((got - want).norm() / want.norm()) <= 1e-5


def test_nemotron_h_moe_q8_0_file_gives_the_dequantized_models_logits(converted, tmp_path):
    """MoE blocks (experts, shared expert, latent projections) quantized; the routers stay F32, as llama-quantize
    leaves them."""
    from gguf import GGUFReader

    qtype = GGMLQuantizationType.Q8_0
    src = converted["nemotron_moe"]
    keep = {"token_embd.weight"} | {t.name for t in GGUFReader(str(src)).tensors if "ffn_gate_inp" in t.name}
    quant = rewrite(src, tmp_path / "nhm-q8.gguf", qtype=qtype, keep=keep)
    ref = rewrite(src, tmp_path / "nhm-ref.gguf", qtype=qtype, keep=keep, dequantized=True, rounded=())
    model, _ = load_model(quant)
    want_model, _ = load_model(ref)
    assert model.layers[3].ffn.shared_experts.up_proj.weight_format == "Q8_0"
    for got, want in zip(forward_logits(model, SEQS), forward_logits(want_model, SEQS)):
        assert float((got - want).norm() / want.norm()) <= 1e-5


def test_blocks_kept_need_float32_activations_or_are_dequantized(converted, tmp_path, capsys):
    quant = rewrite(converted["f32"], tmp_path / "q8.gguf", qtype=GGMLQuantizationType.Q8_0)
    model, _ = load_model(quant, weight_dtype="bf16")  # a float dtype asked for: every tensor dequantized
    assert not _block_bytes(model)
    assert "Q8_0 tensor(s) dequantized to bfloat16 at load" in capsys.readouterr().err
    model, _ = load_model(quant)  # every matrix keeps its blocks, the embedding table too: nothing to say
    assert capsys.readouterr().err == "" and model.embed_tokens.weight_format == "Q8_0"


def test_memory_reads_a_gguf_without_torch(converted):
    code = ("import sys\nfrom kvstate.cli import main\nrc = main(['memory', '--json', sys.argv[1]])\n"
            "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n")
    done = subprocess.run([sys.executable, "-c", code, str(converted["f32"])], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert '"layer_string": "GAGGA"' in done.stdout


def test_memory_fits_a_quantized_gguf_by_its_tensor_bytes(converted, tmp_path, capsys):
    """`--gpu-memory` counts a GGUF's weights as the file holds them (a Q8_0 file: about half its bf16
    parameters), not parameters x the model dtype."""
    import json

    from gguf import GGUFReader

    quant = rewrite(converted["f32"], tmp_path / "q8.gguf", qtype=GGMLQuantizationType.Q8_0)
    held = sum(int(t.n_bytes) for t in GGUFReader(str(quant)).tensors)
    assert main(["memory", str(quant), "--gpu-memory", "1GiB", "--json"]) == 0
    gpu = json.loads(capsys.readouterr().out)[0]["gpu"]
    assert (gpu["weight_bytes"], gpu["weight_source"]) == (held, "gguf")
    assert main(["memory", str(quant), "--gpu-memory", "1GiB"]) == 0
    assert "(GGUF tensors)" in capsys.readouterr().out


def _one_line(capsys, argv, needle):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err and needle in err, err


def test_truncated_file_is_one_line(converted, tmp_path, capsys):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(converted["f32"].read_bytes()[:5000])
    _one_line(capsys, ["memory", str(bad)], "not a readable GGUF file")
    _one_line(capsys, ["generate", "--model", str(bad), "hi"], "not a readable GGUF file")


def test_unknown_architecture_is_one_line(converted, tmp_path, capsys):
    bad = rewrite(converted["f32"], tmp_path / "llama.gguf", arch="llama")
    _one_line(capsys, ["memory", str(bad)], "GGUF architecture 'llama' is not supported")


def test_unsupported_tensor_type_is_one_line(converted, tmp_path, capsys):
    bad = rewrite(converted["f32"], tmp_path / "i32.gguf", retype={"blk.0.ffn_up.weight": np.int32})
    _one_line(capsys, ["generate", "--model", str(bad), "hi"], "'blk.0.ffn_up.weight' has type I32")


def test_missing_tensor_is_one_line(converted, tmp_path, capsys):
    bad = rewrite(converted["f32"], tmp_path / "short.gguf", drop={"blk.2.ffn_up.weight"})
    _one_line(capsys, ["generate", "--model", str(bad), "hi"],
              f"{bad.resolve()}: checkpoint is missing tensors for layers.2")


def test_generate_runs_a_gguf_alone(converted, capsys):
    assert main(["generate", "--model", str(converted["f32"]), "def f(x):", "--max-tokens", "4", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err


def test_hub_repo_and_file_from_the_offline_cache(converted, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    from kvstate.hub import resolve_checkpoint
    from tests.hub_cache import populate

    populate(tmp_path / "hub", "org/tiny-GGUF", {"tiny-f32.gguf": converted["f32"].read_bytes()})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    folder = resolve_checkpoint("org/tiny-GGUF", gguf_file="tiny-f32.gguf")
    assert resolve_checkpoint("org/tiny-GGUF/tiny-f32.gguf") == folder
    model, _ = load_model("org/tiny-GGUF/tiny-f32.gguf")
    plain, _ = load_model(converted["f32"])
    for got, want in zip(forward_logits(model, SEQS), forward_logits(plain, SEQS)):
        assert float((got - want).norm() / want.norm()) == 0.0
    assert main(["memory", "org/tiny-GGUF/tiny-f32.gguf"]) == 0
    capsys.readouterr()
    _one_line(capsys, ["memory", "org/tiny-GGUF/absent.gguf"], "not in the Hugging Face cache")


def test_bench_engine_runs_llama_bench_on_the_same_gguf(converted, tmp_path, capsys):
    import json

    from tests.test_bench_llama_cpp import fake_llama_bench

    binary, _ = fake_llama_bench(tmp_path)
    assert main(["bench", "engine", "--model", str(converted["f32"]), "--batches", "1", "--prompt-len", "6",
                 "--new-tokens", "4", "--prefill-len", "12", "--threads", "1", "--llama-bench", binary,
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    args = json.loads((tmp_path / "args.json").read_text())
    assert args[:2] == ["-m", str(converted["f32"].resolve())]
    assert [r["test"] for r in out["llama_cpp"]] == ["pp12", "tg64"]


def test_llama_quantize_q4_k_m_file_gives_the_dequantized_models_logits(converted, tmp_path):
    from gguf import GGUFReader

    from kvstate.bench.llama_cpp import quantize
    from tests.gguf.conftest import LLAMA_QUANTIZE

    if not LLAMA_QUANTIZE.is_file():
        pytest.skip(f"no llama-quantize at {LLAMA_QUANTIZE}")
    quant = quantize(LLAMA_QUANTIZE, converted["bf16"], "q4_k_m", tmp_path / "q4_k_m.gguf", threads=1)
    tensors = GGUFReader(str(quant)).tensors
    kinds = {t.tensor_type.name for t in tensors}
    assert {"Q4_K", "Q6_K"} <= kinds, kinds
    model, _ = load_model(quant)
    blocks = {m.weight_format for m in model.modules() if getattr(m, "weight_format", None)}
    assert {"Q4_K", "Q6_K"} <= blocks, blocks
    # what the loader dequantizes rather than keeps (other types) is rounded to bf16; the embedding
    # table keeps its blocks
    assert model.embed_tokens.weight_format in blocks
    rounded = {t.name for t in tensors if t.tensor_type.name not in blocks}
    ref = rewrite(quant, tmp_path / "ref.gguf", dequantized=True, rounded=rounded)
    want_model, _ = load_model(ref)
    for got, want in zip(forward_logits(model, SEQS), forward_logits(want_model, SEQS)):
        assert float((got - want).norm() / want.norm()) <= 1e-5


@pytest.mark.parametrize("command", ["memory", "generate"])
def test_every_bad_file_is_one_line_from_memory_and_generate(converted, tmp_path, capsys, command):
    """(`memory` reads the headers only: a missing tensor is found when the weights load, as for safetensors.)"""
    src = converted["f32"]
    data = src.read_bytes()
    cut = tmp_path / "cut-data.gguf"
    cut.write_bytes(data[:len(data) - 4096])  # the header whole, the last tensor's bytes cut
    bad = {
        "not a readable GGUF file": cut,
        "GGUF architecture 'llama' is not supported": rewrite(src, tmp_path / "llama.gguf", arch="llama"),
        "'blk.0.ffn_up.weight' has type I32": rewrite(src, tmp_path / "i32.gguf",
                                                      retype={"blk.0.ffn_up.weight": np.int32}),
        "checkpoint is missing tensors for layers.2": rewrite(src, tmp_path / "short.gguf",
                                                              drop={"blk.2.ffn_up.weight"}),
    }
    for needle, path in bad.items():
        if command == "memory" and "missing" in needle:
            assert main(["memory", str(path)]) == 0
            capsys.readouterr()
            continue
        argv = ["memory", str(path)] if command == "memory" else ["generate", "--model", str(path), "hi"]
        _one_line(capsys, argv, needle)


def test_bench_engine_holds_a_quantized_file_against_its_baseline(converted, tmp_path, capsys):
    import json

    quant = rewrite(converted["f32"], tmp_path / "q8.gguf", qtype=GGMLQuantizationType.Q8_0)
    argv = ["bench", "engine", "--model", str(quant), "--batches", "1", "--prompt-len", "6", "--new-tokens", "2",
            "--prefill-len", "8", "--threads", "1", "--json"]
    assert main(argv + ["--quant-baseline", str(converted["ckpt-f32"])]) == 0
    out = json.loads(capsys.readouterr().out)
    q = out["quant_logit_error"]
    assert out["weight_dtype"] == "Q8_0" and q["positions"] == 6 and q["baseline"] == "ckpt-f32 in fp32"
    assert 0 < q["kl"] < 0.05 and 0 < q["rel"] < 0.1 and 0 <= q["top1"] <= 1
    assert main(argv) == 0  # no baseline: said, not guessed
    out = json.loads(capsys.readouterr().out)
    assert out["quant_logit_error"] is None and "--quant-baseline" in out["quant_baseline_missing"]


def test_first_token_agreement_counts_prompts_whose_greedy_token_matches(converted):
    import torch

    from kvstate.bench.quant_error import first_token_agreement

    model, plan = load_model(converted["f32"])
    same = first_token_agreement(model, model, plan.vocab_size, prompts=6, length=5)
    assert same == dict(agree=1.0, prompts=6, length=5, margin=same["margin"]) and same["margin"] > 0
    other, _ = load_model(converted["f32"])
    with torch.no_grad():  # another head: its greedy tokens are other tokens
        other.lm_head.weight.copy_(torch.randn(other.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    assert first_token_agreement(other, model, plan.vocab_size, prompts=6, length=5)["agree"] < 0.5


def test_the_bench_checkpoints_gguf_tokenizes_as_its_checkpoint(tmp_path):
    """`make_checkpoint`'s tokenizer splits as the pre-tokenizer `convert` names ("qwen2"), so a GGUF of the
    bench checkpoint scores the same tokens (`kvstate eval perplexity --kl-base` across the two)."""
    from kvstate.bench.llama_cpp import convert, make_checkpoint
    from kvstate.hub import resolve_checkpoint
    from kvstate.models.tokenizer import Tokenizer
    from tests.gguf.conftest import LLAMA_CPP

    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"no llama.cpp source tree at {LLAMA_CPP}")
    ckpt = make_checkpoint(tmp_path / "ckpt", "quick")
    ours = Tokenizer(resolve_checkpoint(convert(LLAMA_CPP, ckpt, "f32", tmp_path / "quick.gguf")))
    theirs = Tokenizer(ckpt)
    text = (ROOT / "kvstate" / "data" / "eval" / "phonebook_chats.txt").read_text(encoding="utf-8")[:3000]
    text += "\n  x = 12345  # élan 中文\n\n\tdone"
    assert ours.encode(text) == theirs.encode(text)


def test_eval_perplexity_of_a_quantized_file_against_a_base(converted, tmp_path, capsys):
    import json

    quant = rewrite(converted["f32"], tmp_path / "q8.gguf", qtype=GGMLQuantizationType.Q8_0)
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1  # the tokenizer of the file\n" * 8)
    base = tmp_path / "base.kvb"
    common = ["eval", "perplexity", "--file", str(text), "--context", "32", "--json"]
    assert main(common + ["--model", str(converted["f32"]), "--save-base", str(base)]) == 0
    capsys.readouterr()
    assert main(common + ["--model", str(quant), "--kl-base", str(base)]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["weight_dtype"] == "Q8_0" and 0 < row["kl_mean"] < 0.05 and row["top1_agree"] > 0.5
