"""GGUF files of LFM2, Falcon-H1, Kimi Linear and Granite 4.0 hybrid (written as llama.cpp's converter writes them:
tests/gguf/writer.py) plan as their checkpoints do, and the runnable ones give their logits: F32 within
1e-5 (Falcon-H1's muP multipliers are multiplied into its weights), Q8_0 exactly the logits of the model
holding gguf's dequantization. Bad files are one line and exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from kvstate.cli import main
from kvstate.families import read_plan
from kvstate.models.generate import forward_logits
from kvstate.models.loader import load_model
from tests.gguf.conftest import VOCAB, _tokenizer
from tests.gguf.rewrite import rewrite
from tests.gguf.writer import bf16_checkpoint, write_gguf
from tests.greedy import greedy_generate

ROOT = Path(__file__).resolve().parents[2]
SEQS = [[5, 17, 42, 99, 250, 3, 7, 8, 120, 77, 64, 31, 2], [11]]
RUNNABLE = ["lfm2", "falcon_h1", "falcon_h1_norm", "kimi", "kimi_qlora"]
# Mamba-2, attention, Mamba-2 blocks; 4 experts (top 2) beside the shared MLP
GRANITE = dict(hidden_size=64, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
               num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8,
               mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2, shared_intermediate_size=96, intermediate_size=48,
               num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0, logits_scaling=4.0,
               residual_multiplier=0.5, attention_multiplier=0.25)


def _models():
    from transformers import (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, KimiLinearConfig,
                              KimiLinearForCausalLM)

    from tests.models import test_falcon_h1, test_kimi_linear, test_lfm2
    from tests.models.checks import redraw_weights

    torch.manual_seed(0)
    granite = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(vocab_size=VOCAB, **GRANITE)).eval()
    # KDA (3 heads of 32) and MLA (4 heads) layers, 2 dense FFNs then MoE; one expert group: the converter
    # reads the group count as `n_group`, which transformers' config does not spell (llama.cpp then runs one)
    kimi = KimiLinearForCausalLM(KimiLinearConfig(**{**test_kimi_linear.BASE, **test_kimi_linear.CASES[
        "groups-first2dense"], "vocab_size": VOCAB, "n_group": 1})).eval()
    redraw_weights(kimi, 3)
    # q through a latent, MLA biases, 2 shared experts, MoE and dense FFNs alternating; the routing weights
    # renormalized, as llama.cpp always does
    kimi_qlora = KimiLinearForCausalLM(KimiLinearConfig(**{**test_kimi_linear.BASE, **test_kimi_linear.CASES[
        "qlora-bias-2shared"], "vocab_size": VOCAB, "norm_topk_prob": True})).eval()
    redraw_weights(kimi_qlora, 4)
    # the Mamba output norm as llama.cpp runs it: after the gate
    return {"lfm2": test_lfm2.tiny(0, vocab_size=VOCAB, block_multiple_of=16),
            "falcon_h1": test_falcon_h1.tiny(1, vocab_size=VOCAB),
            "falcon_h1_norm": test_falcon_h1.tiny(2, vocab_size=VOCAB, mamba_rms_norm=True,
                                                  mamba_norm_before_gate=False),
            "kimi": kimi, "kimi_qlora": kimi_qlora, "granite": granite}


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    """kind -> (checkpoint folder, its GGUF file)."""
    root = tmp_path_factory.mktemp("hybrids")
    out = {}
    for kind, model in _models().items():
        ckpt = root / f"ckpt-{kind}"
        model.save_pretrained(ckpt)
        _tokenizer(ckpt)
        out[kind] = ckpt, write_gguf(ckpt, root / f"{kind}.gguf")
    return out


def _memory(capsys, path) -> dict:
    assert main(["memory", "--json", str(path)]) == 0
    return json.loads(capsys.readouterr().out)


def _without_names(value):
    """A memory report without the fields naming its source (the GGUF's general.name, the folder's path)."""
    if isinstance(value, dict):
        return {k: _without_names(v) for k, v in value.items() if k not in ("name", "model", "source")}
    return [_without_names(v) for v in value] if isinstance(value, list) else value


@pytest.mark.parametrize("kind", [*RUNNABLE, "granite"])
def test_plan_and_memory_report_are_the_checkpoints(hybrids, kind, capsys):
    ckpt, gguf = hybrids[kind]
    ours, theirs = read_plan(gguf), read_plan(ckpt)
    assert ours.layer_string == theirs.layer_string and ours.layers == theirs.layers
    assert (ours.hidden_size, ours.vocab_size, ours.tie_word_embeddings, ours.params.total) == \
        (theirs.hidden_size, theirs.vocab_size, theirs.tie_word_embeddings, theirs.params.total)
    got, want = _without_names(_memory(capsys, gguf)), _without_names(_memory(capsys, ckpt))
    if kind == "granite":  # a model without RoPE: the converter writes 2**20 as its context length
        assert got[0].pop("max_position_embeddings") == 2**20
        want[0].pop("max_position_embeddings")
    assert got == want


@pytest.mark.parametrize("kind", RUNNABLE)
def test_logits_and_greedy_tokens_are_the_checkpoints(hybrids, kind):
    ckpt, gguf = hybrids[kind]
    ref, _ = load_model(ckpt)
    model, _ = load_model(gguf)
    for got, want in zip(forward_logits(model, SEQS), forward_logits(ref, SEQS)):
        assert float((got - want).norm() / want.norm()) <= 1e-5, kind
    assert greedy_generate(model, SEQS[0], 8) == greedy_generate(ref, SEQS[0], 8)


@pytest.mark.parametrize("kind", ["lfm2", "kimi"])  # (Falcon-H1's multipliers, folded in bf16, round)
def test_bf16_file_gives_the_bf16_checkpoints_logits(hybrids, kind, tmp_path):
    ckpt = bf16_checkpoint(hybrids[kind][0], tmp_path / "ckpt")
    gguf = write_gguf(ckpt, tmp_path / "bf16.gguf", bf16=True)
    assert "BF16" in {t.tensor_type.name for t in GGUFReader(str(gguf)).tensors}
    ref, _ = load_model(ckpt)
    model, _ = load_model(gguf)
    assert model.lm_head.weight.dtype == ref.lm_head.weight.dtype == torch.bfloat16
    for got, want in zip(forward_logits(model, SEQS), forward_logits(ref, SEQS)):
        assert float((got - want).norm() / want.norm()) <= 1e-5, kind


@pytest.mark.parametrize("kind", RUNNABLE)
def test_q8_0_file_gives_the_dequantized_models_logits(hybrids, kind, tmp_path):
    _, gguf = hybrids[kind]
    q8 = GGMLQuantizationType.Q8_0
    # the embedding table and the routers stay F32, as llama-quantize leaves routers
    keep = {"token_embd.weight"} | {t.name for t in GGUFReader(str(gguf)).tensors if "ffn_gate_inp" in t.name}
    quant = rewrite(gguf, tmp_path / "q8.gguf", qtype=q8, keep=keep)
    ref = rewrite(gguf, tmp_path / "ref.gguf", qtype=q8, keep=keep, dequantized=True, rounded=())
    model, _ = load_model(quant)
    want_model, _ = load_model(ref)
    plain, _ = load_model(gguf)
    assert {m.weight_format for m in model.modules() if getattr(m, "weight_format", None)} == {"Q8_0"}
    for got, want, orig in zip(forward_logits(model, SEQS), forward_logits(want_model, SEQS),
                               forward_logits(plain, SEQS)):
        assert float((got - want).norm() / want.norm()) <= 1e-5
        assert float((got - orig).norm() / orig.norm()) > 1e-4  # the quantization did change the weights


def test_llm_and_generate_run_the_file_alone(hybrids, capsys):
    from kvstate import LLM, SamplingParams

    ckpt, gguf = hybrids["lfm2"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got, want = LLM(str(gguf)).generate(["def f(x):"], params)[0], LLM(str(ckpt)).generate(["def f(x):"], params)[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    assert main(["generate", "--model", str(hybrids["falcon_h1"][1]), "def f(x):", "--max-tokens", "3",
                 "--ignore-eos"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_memory_reads_a_granite_file_without_torch(hybrids):
    code = ("import sys\nfrom kvstate.cli import main\nrc = main(['memory', '--json', sys.argv[1]])\n"
            "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n")
    done = subprocess.run([sys.executable, "-c", code, str(hybrids["granite"][1])], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert '"layer_string": "MAM"' in done.stdout


def _one_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and needle in err, err


def test_bad_files_are_one_line(hybrids, tmp_path, capsys):
    _, lfm2 = hybrids["lfm2"]
    short = rewrite(lfm2, tmp_path / "short.gguf", drop={"blk.2.shortconv.in_proj.weight"})
    _one_line(capsys, ["generate", "--model", str(short), "hi"], "checkpoint is missing tensors for layers.2")
    _one_line(capsys, ["memory", str(rewrite(lfm2, tmp_path / "lfm9.gguf", arch="lfm9"))],
              "GGUF architecture 'lfm9' is not supported")
    _one_line(capsys, ["generate", "--model", str(hybrids["granite"][1]), "hi"],
              "model_type 'granitemoehybrid' can be planned but not run")
