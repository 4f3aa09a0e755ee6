"""Jamba GGUF files (written as llama.cpp's converter writes them: tests/gguf/writer.py) plan and run as
their checkpoint, and the SentencePiece tokenizer read from the file ("llama" model: pieces, scores, token
types, <0xNN> byte fallback) encodes and decodes like the checkpoint's tokenizer.json."""

from pathlib import Path

import pytest
import torch

from kvstate.families import read_plan
from kvstate.hub import resolve_checkpoint
from kvstate.models.generate import forward_logits
from kvstate.models.loader import load_model
from kvstate.models.tokenizer import Tokenizer
from tests.gguf.writer import write_gguf
from tests.greedy import greedy_generate

VOCAB = 400
SEQS = [[5, 17, 42, 99, 250, 3, 7, 8, 120, 77, 64, 31, 2], [11]]
TEXTS = ["Hello world, 12345 tokens!", "def f(x):\n    return x  # élan ünïcode 中文 🙂", "  two spaces\n\n\tand tabs ",
         "<s>hi</s> there", " leading space", "", "ÿ\x00\x7f€"]


def spm_tokenizer(folder: Path) -> None:
    """A SentencePiece-style BPE tokenizer (as transformers converts Llama's): "▁" for spaces and one before
    the text, byte fallback to <0xNN> tokens; trained on kvstate's sources, no download."""
    from tokenizers import Tokenizer as Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tok(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special, limit_alphabet=60)
    sources = sorted((Path(__file__).parents[2] / "kvstate" / "gguf").glob("*.py"))
    tok.train_from_iterator([line for p in sources for line in p.read_text(encoding="utf-8").splitlines()], trainer)
    # byte tokens are vocabulary, not added tokens: byte_fallback looks them up in the model's vocabulary
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            add_bos_token=True).save_pretrained(folder)


@pytest.fixture(scope="module")
def jamba(tmp_path_factory):
    from tests.models import test_jamba
    from tests.models.checks import redraw_weights
    from transformers import JambaConfig, JambaForCausalLM

    root = tmp_path_factory.mktemp("jamba")
    torch.manual_seed(0)
    hf = JambaForCausalLM(JambaConfig(**{**test_jamba.BASE, **test_jamba.CASES["head32"], "vocab_size": VOCAB})).eval()
    redraw_weights(hf, 0)
    hf.save_pretrained(root / "ckpt")
    spm_tokenizer(root / "ckpt")
    return root / "ckpt", write_gguf(root / "ckpt", root / "jamba.gguf")


def test_jamba_plan_and_logits_are_the_checkpoints(jamba):
    ckpt, gguf = jamba
    ours, theirs = read_plan(gguf), read_plan(ckpt)
    assert ours.layer_string == theirs.layer_string == "SASSAS" and ours.layers == theirs.layers
    assert [layer.ffn.kind for layer in ours.layers] == ["mlp", "moe"] * 3
    ref, _ = load_model(ckpt)
    model, _ = load_model(gguf)
    for got, want in zip(forward_logits(model, SEQS), forward_logits(ref, SEQS)):
        assert float((got - want).norm() / want.norm()) <= 1e-5
    assert greedy_generate(model, SEQS[0], 8) == greedy_generate(ref, SEQS[0], 8)


def test_sentencepiece_tokenizer_from_the_file_encodes_and_decodes_like_the_checkpoints(jamba):
    ckpt, gguf = jamba
    ours, theirs = Tokenizer(resolve_checkpoint(gguf)), Tokenizer(ckpt)
    text = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")[:4000]
    for t in [*TEXTS, text]:
        got, want = ours.encode(t), theirs.encode(t)
        assert got == want, t
        assert ours.decode(got) == theirs.decode(want), t
    assert ours.encode("hi")[0] == theirs.encode("hi")[0] == 1  # BOS added, as llama.cpp's SentencePiece does
    assert any(i >= 3 and i < 259 for i in ours.encode("中")), "an unseen character falls back to byte tokens"
    assert ours.eos_token_ids == theirs.eos_token_ids


def test_jamba_q8_0_file_gives_the_dequantized_models_logits(jamba, tmp_path):
    from gguf import GGMLQuantizationType

    from tests.gguf.rewrite import rewrite

    _, gguf = jamba
    q8 = GGMLQuantizationType.Q8_0
    # the routers stay F32, as llama-quantize leaves them
    keep = {"token_embd.weight"} | {f"blk.{i}.ffn_gate_inp.weight" for i in range(6)}
    quant = rewrite(gguf, tmp_path / "q8.gguf", qtype=q8, keep=keep)
    ref = rewrite(gguf, tmp_path / "ref.gguf", qtype=q8, keep=keep, dequantized=True, rounded=())
    model, _ = load_model(quant)
    want_model, _ = load_model(ref)
    assert {m.weight_format for m in model.modules() if getattr(m, "weight_format", None)} == {"Q8_0"}
    for got, want in zip(forward_logits(model, SEQS), forward_logits(want_model, SEQS)):
        assert float((got - want).norm() / want.norm()) <= 1e-5
