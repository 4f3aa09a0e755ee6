"""Documents of kvstate's local lm-evaluation-harness tasks, made on the fly (no download, no hub).

The YAMLs beside this file name these functions as `custom_dataset`; lm-eval imports this file by
path. Each document set is drawn from a fixed seed with kvstate's phone-book and passage
generators, in the shipped models' chat layout (kvstate.recall.chat_data), so every run scores the
same documents.
"""

import numpy as np

ENTRIES = 8  # phone-book entries per book
CHOICES = 4  # the right number and three others from the same book
DOCS = 64


def _user(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def _books(seed: int):
    from kvstate.recall.tasks import phonebook_entries, phonebook_prompt

    rng = np.random.default_rng(seed)
    for _ in range(DOCS):
        book = phonebook_entries(ENTRIES, rng)
        asked = int(rng.integers(ENTRIES))
        name, number = book[asked]
        others = [book[i][1] for i in rng.choice([i for i in range(ENTRIES) if i != asked], CHOICES - 1,
                                                 replace=False)]
        yield rng, _user(phonebook_prompt(book, name).rstrip()), name, number, others


def _dataset(rows: list[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def phonebook_mc(**kwargs):
    """Multiple choice: the book, the question, the reply up to the name; which of 4 numbers follows."""
    rows = []
    for rng, prompt, name, number, others in _books(3801):
        choices = [number, *others]
        order = rng.permutation(CHOICES)
        rows.append({"context": f"{prompt}{name}:", "choices": [f" {choices[i]}" for i in order],
                     "label": int(np.argmax(order == 0))})
    return _dataset(rows)


def phonebook_gen(**kwargs):
    """Generation: the book and the question; the reply must be `Name: number` exactly."""
    return _dataset([{"context": prompt, "answer": f"{name}: {number}"}
                     for _, prompt, name, number, _ in _books(3802)])


def copy_rolling(**kwargs):
    """Whole copy chats (`Repeat this:`, a passage, the assistant's copy), scored token by token."""
    from kvstate.recall.chat_data import copy_chat, render

    rng = np.random.default_rng(3803)
    return _dataset([{"text": render(copy_chat(rng, 16))} for _ in range(DOCS)])
