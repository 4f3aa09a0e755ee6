"""A tiny Qwen3.5 checkpoint (fp32 and bf16) with a Qwen2-style byte-level BPE tokenizer and a chat
template (and a tiny Qwen3.5 MoE, Qwen3-Next and Mamba-2), and the GGUF files llama.cpp's own
converter makes of them (run in a child with its gguf-py; skipped where the llama.cpp source tree is
absent). Each GGUF folder goes to a per-session cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

LLAMA_CPP = Path(os.environ.get("KVSTATE_LLAMA_CPP_SOURCE", "/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp"))
LLAMA_QUANTIZE = LLAMA_CPP / "build" / "bin" / "llama-quantize"
VOCAB = 300
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("KVSTATE_GGUF_CACHE", str(tmp_path_factory.getbasetemp() / "gguf-cache"))


def _tokenizer(path: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvstate.gguf.tokenizer import PRE_TOKENIZERS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZERS["qwen2"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    sources = sorted((Path(__file__).parents[2] / "kvstate" / "gguf").glob("*.py"))
    corpus = [p.read_text(encoding="utf-8") for p in sources]
    tok.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                            chat_template=TEMPLATE).save_pretrained(path)


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """{"f32", "bf16", "moe", "next", "mamba2", "nemotron_h", "nemotron_moe"} and each with "ckpt-" -> path: the
    GGUF files and their checkpoints (Qwen3.5 dense in fp32 and bf16; Qwen3.5 MoE, Qwen3-Next, Mamba-2, a
    Nemotron-H of Mamba-2, attention and MLP blocks and one with MoE blocks too, in fp32)."""
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"no llama.cpp source tree at {LLAMA_CPP} (set KVSTATE_LLAMA_CPP_SOURCE)")
    from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig,
                              Qwen3NextConfig, Qwen3NextForCausalLM, Mamba2Config, Mamba2ForCausalLM,
                              NemotronHConfig, NemotronHForCausalLM)

    from kvstate.bench.llama_cpp import convert
    from tests.models.checks import redraw_weights
    from tests.models.test_qwen3_5 import TEXT
    from tests.models.test_mamba2 import BASE as MAMBA2
    from tests.models.test_nemotron_h import BASE as NEMOTRON_H
    from tests.models.test_qwen3_next import BASE as NEXT

    root = tmp_path_factory.mktemp("gguf")
    torch.manual_seed(0)
    # hidden 256: rows of 256, so llama-quantize writes K-quant blocks (Q4_K, Q6_K), not only fallbacks
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=96, **{**TEXT, "vocab_size": VOCAB,
                                                                      "hidden_size": 256})).eval()
    redraw_weights(hf, 0)
    out = {}
    for dtype, outtype in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        ckpt = root / f"ckpt-{outtype}"
        hf.to(dtype).save_pretrained(ckpt)
        _tokenizer(ckpt)
        out[f"ckpt-{outtype}"] = ckpt
        out[outtype] = convert(LLAMA_CPP, ckpt, outtype, root / f"tiny-{outtype}.gguf")
    torch.manual_seed(1)
    moe = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                     shared_expert_intermediate_size=48,
                                                     **{**TEXT, "vocab_size": VOCAB})).eval()
    torch.manual_seed(2)
    nxt = Qwen3NextForCausalLM(Qwen3NextConfig(**{**NEXT, "vocab_size": VOCAB})).eval()
    torch.manual_seed(3)
    mamba2 = Mamba2ForCausalLM(Mamba2Config(**{**MAMBA2, "vocab_size": VOCAB})).eval()
    torch.manual_seed(4)  # Mamba-2, attention and MLP blocks (the converter writes nemotron_h_moe: MoE fields)
    nemotron = NemotronHForCausalLM(NemotronHConfig(**{**NEMOTRON_H, "vocab_size": VOCAB,
                                                       "hybrid_override_pattern": "M*-M-*"})).eval()
    torch.manual_seed(5)  # and MoE blocks: relu^2 experts in 2 routing groups, a shared expert, a latent projection
    nemotron_moe = NemotronHForCausalLM(NemotronHConfig(**{**NEMOTRON_H, "vocab_size": VOCAB, "moe_latent_size": 40,
                                                           "hybrid_override_pattern": "M*-EM*E"})).eval()
    for kind, model in (("moe", moe), ("next", nxt), ("mamba2", mamba2), ("nemotron_h", nemotron),
                        ("nemotron_moe", nemotron_moe)):
        redraw_weights(model, 1)
        model.save_pretrained(root / f"ckpt-{kind}")
        _tokenizer(root / f"ckpt-{kind}")
        out[f"ckpt-{kind}"] = root / f"ckpt-{kind}"
        no_mtp = kind not in ("mamba2", "nemotron_h", "nemotron_moe")  # families whose converter refuses --no-mtp
        out[kind] = convert(LLAMA_CPP, root / f"ckpt-{kind}", "f32", root / f"{kind}.gguf", no_mtp=no_mtp)
    return out


def convert_tiny_qwen35(root: Path, seed: int, intermediate_size: int = 96, **overrides) -> tuple[Path, Path]:
    """(checkpoint, f32 GGUF by llama.cpp's converter) of a tiny Qwen3.5 (tests.models.test_qwen3_5's TEXT
    with `overrides`), random weights of `seed`; skipped where the llama.cpp source tree is absent."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from kvstate.bench.llama_cpp import convert
    from tests.models.checks import redraw_weights
    from tests.models.test_qwen3_5 import TEXT

    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"no llama.cpp source tree at {LLAMA_CPP}")
    torch.manual_seed(seed)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=intermediate_size,
                                              **{**TEXT, "vocab_size": VOCAB, **overrides})).eval()
    redraw_weights(hf, seed)
    hf.save_pretrained(root / "ckpt")
    _tokenizer(root / "ckpt")
    return root / "ckpt", convert(LLAMA_CPP, root / "ckpt", "f32", root / "f32.gguf")
