"""A GGUF file made by llama.cpp's own converter loads into the model the checkpoint gives: same plan,
same logits (F32 and BF16 files; Qwen3.5 dense and MoE, Qwen3-Next, Mamba-2, Nemotron-H with and without
MoE blocks), same tokenizer and chat template."""

import json

import torch

from kvstate.families import read_plan
from kvstate.hub import resolve_checkpoint
from kvstate.models.generate import forward_logits
from tests.greedy import greedy_generate
from kvstate.models.loader import load_model
from kvstate.models.tokenizer import Tokenizer

SEQS = [[5, 17, 42, 99, 250, 3, 7, 8, 120, 77, 64, 31, 2], [11]]


def test_gguf_plan_is_the_checkpoints(converted):
    for kind in ("f32", "bf16", "moe", "next", "mamba2", "nemotron_h", "nemotron_moe"):
        ours, theirs = read_plan(converted[kind]), read_plan(converted[f"ckpt-{kind}"])
        assert ours.layer_string == theirs.layer_string
        assert ours.layers == theirs.layers
        assert (ours.hidden_size, ours.vocab_size, ours.tie_word_embeddings) == \
            (theirs.hidden_size, theirs.vocab_size, theirs.tie_word_embeddings)


def test_gguf_logits_equal_the_checkpoints(converted):
    for kind in ("f32", "bf16", "moe", "next", "mamba2", "nemotron_h", "nemotron_moe"):
        ref, _ = load_model(converted[f"ckpt-{kind}"])
        model, plan = load_model(converted[kind])
        dtype = torch.bfloat16 if kind == "bf16" else torch.float32
        assert model.lm_head.weight.dtype == ref.lm_head.weight.dtype == dtype
        for got, want in zip(forward_logits(model, SEQS), forward_logits(ref, SEQS)):
            assert float((got - want).norm() / want.norm()) <= 1e-5, kind
        assert greedy_generate(model, SEQS[0], 8) == greedy_generate(ref, SEQS[0], 8)


def test_gguf_tokenizer_encodes_decodes_and_templates_like_the_checkpoints(converted):
    ours, theirs = Tokenizer(resolve_checkpoint(converted["f32"])), Tokenizer(converted["ckpt-f32"])
    texts = ["Hello world, 12345 tokens!", "def f(x):\n    return x  # élan ünïcode 中文", "  spaces\n\n\tand tabs ",
             "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 + 2?"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)
    assert ours.eos_token_ids == theirs.eos_token_ids


def test_gguf_folder_is_reused_and_names_the_file(converted):
    first = resolve_checkpoint(converted["f32"])
    assert resolve_checkpoint(str(converted["f32"])) == first
    config = json.loads((first / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["gguf_architecture"] == "qwen35"


def test_llm_takes_a_gguf_and_chats_like_the_checkpoint(converted):
    from kvstate import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    messages = [{"role": "user", "content": "def f(x):"}]
    ours, theirs = LLM(str(converted["f32"])), LLM(str(converted["ckpt-f32"]))
    assert ours.tokenizer.apply_chat_template(messages) == theirs.tokenizer.apply_chat_template(messages)
    got, want = ours.generate(["def f(x):"], params)[0], theirs.generate(["def f(x):"], params)[0]
    assert got.token_ids == want.token_ids and got.text == want.text


def test_the_folders_tensor_table_reads_as_gguf_reads_the_file(converted, tmp_path):
    """The loader reads tensors through the folder's table (no metadata parse): the same tensors, bytes and
    views as gguf's reader, and a quantized file loads the same through either."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader

    from kvstate.gguf.tensors import open_tensors
    from tests.gguf.rewrite import rewrite

    quant = rewrite(converted["bf16"], tmp_path / "q4_0.gguf", qtype=GGMLQuantizationType.Q4_0)
    for path in (converted["f32"], converted["bf16"], quant):
        table = open_tensors(resolve_checkpoint(path) / "model.gguf")
        theirs = GGUFReader(str(path)).tensors
        assert [t.name for t in table.tensors] == [t.name for t in theirs]
        for ours, t in zip(table.tensors, theirs):
            assert ours.tensor_type == t.tensor_type and ours.data.shape == t.data.shape
            assert ours.data.dtype == t.data.dtype and np.array_equal(ours.data, t.data), t.name
