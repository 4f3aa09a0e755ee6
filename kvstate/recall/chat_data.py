"""Chat-format training text for the shipped phonebook models, and their word-level tokenizer.

The two shipped models (`kvstate recall train-default`) learn two skills in Qwen's chat format:

- **phonebook**: the user sends a phone book (`Name Surname: 1234` lines) and a question
  "What is Name Surname's number?"; the assistant answers with the book's line,
  "Name Surname: 1234". Repeating the name first turns the lookup into the copy skill (find
  where the text just written occurred before and continue it), the same skill as the copy
  chats, and the one tiny attention learns first; answering the bare digits asks for the name
  to be carried across the chat markers to the reply, which the same models did not learn in
  600 steps. Later turns ask about other entries of the same book (more answers per token of
  context, so training is cheaper);
- **copy**: "Repeat this:" and a passage of random words; the assistant repeats it.

The tokenizer is word-level (a word with or without its leading space is one token, a phone
book's full name too, digits two a token), so a 64-entry book is ~390 tokens rather than ~1,200
characters, and a 4-digit answer is two tokens. Full names and digits never take a leading space
(a space before them is a token of its own): the name asked is then the very token of the book's
line, and the digits answered are the very tokens stored there. With `' Nadia Khan'` in the
question and `'Nadia Khan'` in the book, a model would have to learn, name by name, that two
random embeddings mean the same key; the lookup is never found in a training run of minutes. It is a real
`tokenizers` tokenizer.json that transformers and kvstate both load; a Fuse decoder joins the
tokens back into text (the spaces live in the tokens). No torch here.

    tok = build_tokenizer()
    seq = encode_chat(tok, phonebook_chat(rng, 8, turns=3))   # ids [T] and a loss mask [T]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstate.recall.tasks import FIRST_NAMES, FILLER, LAST_NAMES, phonebook_entries, phonebook_prompt

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
UNK = "<unk>"
EOS = "<|im_end|>"
# Qwen's chat template, without tools or thinking: one message per `<|im_start|>role\n...<|im_end|>\n`.
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")
# words of the copy passages and of the prompts (each also capitalised, with and without a leading space)
WORDS = tuple(sorted({w.strip(".").lower() for s in FILLER for w in s.split()} | set(
    "a an and are as at be been but by can cat day do dog for from go good green has have he her here him his "
    "home house how i if in into is it its just like little long make many me more most my new no not now of "
    "old on one only or other our out over people red repeat run said see she so some take than that the their "
    "them then there these they thing think this time to two up us very was water way we well what when where "
    "which who will with word work would year you your book phone number city road tree light night stone "
    "small big fast slow open close left right blue yellow black white".split())))
PUNCT = (":", "?", ".", ",", "!", "'s", "-", "'")
FULL_NAMES = tuple(f"{first} {last}" for first in FIRST_NAMES for last in LAST_NAMES)
# A full name of the phone book (one token: the lookup key is one token, as in MQAR), a word
# (optionally after one space), two digits (or a last single one), a line break, one other
# character (optionally after one space), or a lone space: every character lands in exactly one
# piece. Names and digits never start with a space, so a key and an answer are the same token
# wherever they appear.
_NAME = r"(?:" + "|".join(FIRST_NAMES) + ") (?:" + "|".join(LAST_NAMES) + r")\b"
PIECES = (r"'s| (?=" + _NAME + ")|" + _NAME + r"| ?[A-Za-z]+|[0-9]{1,2}|\n| ?[^\sA-Za-z0-9]|\s")


def vocabulary() -> list[str]:
    words = set(FIRST_NAMES) | set(LAST_NAMES) | {"What", "Repeat", "this", "user", "assistant", "system"}
    words |= set(WORDS) | {w.capitalize() for w in WORDS}
    tokens = sorted(words) + sorted(" " + w for w in words) + sorted(FULL_NAMES)  # names: no leading space
    digits = [str(d) for d in range(10)] + [f"{d:02d}" for d in range(100)]  # two digits a token, no space
    tokens += digits
    tokens += list(PUNCT) + [" " + p for p in PUNCT if p != "'s"] + ["\n", " "]
    return [*SPECIAL, UNK, *dict.fromkeys(tokens)]


def build_tokenizer():
    """A `tokenizers.Tokenizer`: word-level over `vocabulary()`, chat markers as special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {t: i for i, t in enumerate(vocabulary())}
    tok = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PIECES), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL))
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json: the chat template and the special tokens transformers and kvstate read."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, "eos_token": EOS,
            "pad_token": "<|endoftext|>", "unk_token": UNK, "bos_token": None, "add_bos_token": False,
            "model_max_length": 4096, "clean_up_tokenization_spaces": False}


# ---- chats ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Chat:
    messages: list[dict[str, str]]  # user / assistant turns; the assistant's are trained
    answers: list[str]  # the assistant replies, in order
    kind: str = "phonebook"  # or "copy"


def phonebook_question(name: str) -> str:
    return f"What is {name}'s number?"


def phonebook_chat(rng: np.random.Generator, entries: int, *, turns: int = 1, digits: int = 4) -> Chat:
    """A book of `entries` entries in the first user message, then `turns` questions (distinct names
    while the book has enough), each answered by the assistant."""
    book = phonebook_entries(entries, rng, digits=digits)
    asked = rng.choice(entries, size=turns, replace=turns > entries)
    messages, answers = [], []
    for t, i in enumerate(asked):
        name, number = book[i]
        text = phonebook_prompt(book, name).rstrip() if t == 0 else phonebook_question(name)
        reply = f"{name}: {number}"
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
        answers.append(reply)
    return Chat(messages, answers)


def passage(rng: np.random.Generator, num_words: int) -> str:
    """Random words as sentences of 4-10 words (capitalised, ending in a period)."""
    out, left = [], num_words
    while left > 0:
        n = min(left, int(rng.integers(4, 11)))
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), size=n)]
        out.append(" ".join([words[0].capitalize(), *words[1:]]) + ".")
        left -= n
    return " ".join(out)


def copy_chat(rng: np.random.Generator, num_words: int) -> Chat:
    text = passage(rng, num_words)
    return Chat([{"role": "user", "content": f"Repeat this:\n{text}"}, {"role": "assistant", "content": text}], [text],
                "copy")


def encode_chat(tok, chat: Chat) -> tuple[list[int], list[bool]]:
    """Token ids of the chat in the template's layout, and which positions are trained (the
    assistant's reply tokens and its `<|im_end|>`). Pieces are encoded apart: each starts at a
    token boundary of the whole text (a test holds this to encoding the rendered template)."""
    ids: list[int] = []
    trained: list[bool] = []
    for m in chat.messages:
        head = tok.encode(f"<|im_start|>{m['role']}\n", add_special_tokens=False).ids
        body = tok.encode(m["content"] + EOS, add_special_tokens=False).ids
        tail = tok.encode("\n", add_special_tokens=False).ids
        reply = m["role"] == "assistant"
        ids += head + body + tail
        trained += [False] * len(head) + [reply] * len(body) + [False] * len(tail)
    return ids, trained


def render(chat: Chat) -> str:
    """The chat as the template renders it (no generation prompt)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in chat.messages)
