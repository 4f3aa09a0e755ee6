"""Tokenizer and chat template: kvstate's (tokenizers + jinja2) against transformers' on a tiny trained BPE."""

import json
import subprocess
import sys

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvstate.errors import KvstateError
from kvstate.models.tokenizer import Tokenizer

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXT = ["the quick brown fox jumps over the lazy dog", "hybrid models keep a fixed state and a growing cache",
        "Gated DeltaNet, KDA, Mamba-2 and Mamba-1 layers", "how many requests fit on my GPU at 128K?"]


def write_tokenizer(path):
    """A byte-level BPE trained on a few sentences, with a Qwen-style chat template, saved into `path`."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT * 10, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


def test_encode_decode_match_transformers(checkpoint):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(checkpoint))
    ours = Tokenizer(checkpoint)
    for text in TEXT + ["unseen wörds ✓ and 128K"]:
        assert ours.encode(text) == ref.encode(text)
        assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)


def test_chat_template_matches_transformers(checkpoint):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(checkpoint))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how much memory at 128K?"}]
    ours = Tokenizer(checkpoint).apply_chat_template(messages)
    assert ours == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n")


def test_eos_ids_gathered(checkpoint):
    assert Tokenizer(checkpoint).eos_token_ids == {1, 2}


def test_missing_tokenizer_and_template_errors(tmp_path, checkpoint):
    with pytest.raises(KvstateError, match="no tokenizer.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text((checkpoint / "tokenizer.json").read_text())
    with pytest.raises(KvstateError, match="no chat template"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_renders_without_transformers_imported(checkpoint):
    # jinja2.ext is a submodule: only an explicit import loads it, and in the tests transformers
    # had always imported it first. A fresh interpreter shows what `kvstate generate --chat` sees.
    code = ("import sys; from kvstate.models.tokenizer import Tokenizer; "
            f"out = Tokenizer({str(checkpoint)!r}).apply_chat_template([{{'role': 'user', 'content': 'hi'}}]); "
            "assert 'transformers' not in sys.modules; print(out)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("<|im_start|>assistant\n\n")


@pytest.mark.parametrize("content", ["{not json", '{"model": {"type": "NoSuchModel"}}', ""])
def test_malformed_tokenizer_json_is_one_line_naming_the_file(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(KvstateError, match=r"tokenizer\.json: not a valid tokenizer\.json") as info:
        Tokenizer(tmp_path)
    assert "\n" not in str(info.value)
