"""Jamba GGUF files (written as llama.cpp's converter writes them: tests/gguf/writer.py) plan and run as
their checkpoint, and the SentencePiece tokenizer read from the file ("llama" model: pieces, scores, token
types, <0xNN> byte fallback) encodes and decodes like the checkpoint's tokenizer.json; Kimi's "kimi-k2"
byte-level split is its tiktoken pattern; LFM2's and Falcon-H1's ("lfm2", "falcon-h1") run as Llama 3's."""

import json
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
    """A SentencePiece-style BPE tokenizer as Llama 2's tokenizer.json has it: "▁" for spaces and one more before
    the text (and after a special token), byte fallback to <0xNN> tokens; trained on kvstate's sources."""
    from tokenizers import Tokenizer as Tok
    from tokenizers import decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tok(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
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


def test_jamba_layers_that_no_period_and_offset_give_are_one_line(jamba, tmp_path, capsys):
    """MoE blocks at 3 and 5 only: every second layer from 3, which Jamba's config cannot say (offset < period)."""
    from kvstate.cli import main
    from tests.gguf.rewrite import rewrite

    drop = {f"blk.1.{kind}_exps.weight" for kind in ("ffn_gate", "ffn_up", "ffn_down")}
    bad = rewrite(jamba[1], tmp_path / "odd.gguf", drop=drop)
    assert main(["memory", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the MoE layers [3, 5] are not every k-th layer" in err, err


def test_jamba_bf16_file_gives_the_bf16_checkpoints_logits(jamba, tmp_path):
    from tests.gguf.writer import bf16_checkpoint

    ckpt = bf16_checkpoint(jamba[0], tmp_path / "ckpt")
    ref, _ = load_model(ckpt)
    model, _ = load_model(write_gguf(ckpt, tmp_path / "bf16.gguf", bf16=True))
    assert model.lm_head.weight.dtype == ref.lm_head.weight.dtype == torch.bfloat16
    for got, want in zip(forward_logits(model, SEQS), forward_logits(ref, SEQS)):
        assert float((got - want).norm() / want.norm()) <= 1e-5


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


# Kimi's pattern as tokenization_kimi.py spells it, read by the `regex` module (set operations: VERSION1)
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+"""])


def test_kimi_k2_pre_tokenizer_splits_as_kimis_pattern(tmp_path):
    """A byte-level BPE file whose pre-tokenizer is "kimi-k2" (Kimi Linear's converter writes it) splits text
    as Kimi's tiktoken pattern does: Han runs alone, letters of other scripts by case, digits by three."""
    import regex
    from gguf import GGUFWriter
    from tokenizers import Tokenizer as Tok
    from tokenizers import pre_tokenizers

    from kvstate.gguf.fields import open_reader
    from kvstate.gguf.tokenizer import tokenizer_files

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    w = GGUFWriter(str(tmp_path / "k2.gguf"), "kimi-linear")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("kimi-k2")
    w.add_token_list(sorted(byte_chars))
    w.add_token_merges([])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tok.from_str(json.dumps(tokenizer_files(open_reader(tmp_path / "k2.gguf"))[0]))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for text in ["Hello World, I'm 1234567 tokens!", "中文混合English文本 and 日本語のテキスト",
                 "HTTPServer isOK  \n\n\tdone", "ÉLAN élan Ñandú don'T", "  x = 12 # 注释\r\n"]:
        want = [byte_level.pre_tokenize_str(piece)[0][0] for piece in regex.findall(KIMI_PATTERN, text,
                                                                                     flags=regex.V1)]
        assert [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text)] == want, text
    assert "".join(tok.decode(tok.encode("中文 text").ids)) == "中文 text"


# Llama 3's split regex as its tokenizer.json has it (llama-vocab.cpp quotes it for LLAMA3)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")


def test_lfm2_pre_tokenizer_takes_whole_words_and_adds_bos_as_llama3s(tmp_path):
    """LFM2's and Falcon-H1's files name their tokenizer "lfm2" / "falcon-h1", which llama.cpp runs as Llama 3's:
    its split, a word that is a token taken whole even where no merge makes it, BOS first."""
    from gguf import GGUFWriter
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as Tok

    from kvstate.gguf.tokenizer import write_tokenizer
    from kvstate.gguf.fields import open_reader

    tok = Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    sources = sorted((Path(__file__).parents[2] / "kvstate" / "gguf").glob("*.py"))
    tok.train_from_iterator([p.read_text(encoding="utf-8") for p in sources], trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    vocab["\u0120zzqq"] = len(vocab)  # " zzqq": a token no merge makes
    spec["model"]["ignore_merges"] = True
    theirs_dir = tmp_path / "theirs"
    theirs_dir.mkdir()
    (theirs_dir / "tokenizer.json").write_text(json.dumps(spec))
    (theirs_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True}))
    w = GGUFWriter(str(tmp_path / "lfm2.gguf"), "lfm2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("lfm2")
    tokens = sorted(vocab, key=vocab.get)
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    ours_dir = tmp_path / "ours"
    ours_dir.mkdir()
    write_tokenizer(open_reader(tmp_path / "lfm2.gguf"), ours_dir)
    ours, theirs = Tokenizer(ours_dir), Tokenizer(theirs_dir)
    for text in [*TEXTS, "a zzqq b", "def f(x):\n    return 1234567"]:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    assert ours.encode("a zzqq")[:1] == [0] and vocab["\u0120zzqq"] in ours.encode("a zzqq")


@pytest.mark.parametrize("vocab", ["llama-spm", "llama-bpe"])
def test_tokenizer_gives_llama_cpps_own_test_vectors(vocab):
    """llama.cpp's vocabulary test files (models/ggml-vocab-*.gguf, .inp, .out: Llama 2's SentencePiece and Llama
    3's byte-level BPE, the tokens its test-tokenizer-0 expects, without BOS): every input encodes to them."""
    from tests.gguf.conftest import LLAMA_CPP
    from tokenizers import Tokenizer as Tok

    from kvstate.gguf.fields import open_reader
    from kvstate.gguf.tokenizer import tokenizer_files

    path = LLAMA_CPP / "models" / f"ggml-vocab-{vocab}.gguf"
    if not path.with_name(path.name + ".out").is_file():
        pytest.skip(f"no llama.cpp vocabulary tests at {path.parent}")
    tok = Tok.from_str(json.dumps(tokenizer_files(open_reader(path))[0]))
    inputs = path.with_name(path.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outputs = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    assert len(inputs) >= 40 and len(outputs) >= len(inputs)
    for text, out in zip(inputs, outputs):
        assert tok.encode(text, add_special_tokens=False).ids == [int(t) for t in out.split()], repr(text)
