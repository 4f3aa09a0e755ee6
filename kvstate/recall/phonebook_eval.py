"""The phonebook test through the engine: exact recall against book size, with the cache it took.

For each book size, `queries` fresh books (seeded), each with one question, run through
`kvstate.llm.LLM` greedily as one batch: in the checkpoint's chat format when it has a
chat template (the user message is the book and the question), as a plain prompt otherwise. A
reply counts when the first number in it is the number asked, digit for digit
(`tasks.first_number`: "8695", "Nadia Khan: 8695" and "It is 8695." all count; "869" or
"86950" do not). Each row
also gives the mean prompt length and the cache a request of that length holds, from the cache
spec the engine allocates from (`kvstate.cache.spec`, float32 on CPU): KV bytes grow with the
prompt, state bytes (recurrent state + conv window) are fixed per request.

    rows = phonebook_curve(LLM("kvstate-phonebook-hybrid"), [4, 16, 64])
    # [{"entries": 4, "prompt_tokens": 54, "accuracy": 1.0, "kv_bytes": 13824, "state_bytes": 26112}, ...]
"""

from __future__ import annotations

from typing import Callable

from kvstate.recall.tasks import first_number, phonebook

ROW_KEYS = ("entries", "prompt_tokens", "accuracy", "kv_bytes", "state_bytes")
REPLY_TOKENS = 12  # room for words around the number ("Nadia Khan: 8695", "Her number is 8695.")


def phonebook_prompts(llm, entries: int, queries: int, *, seed: int, digits: int) -> tuple[list[dict], list[str]]:
    """(engine prompts with their token ids, expected answers) for `queries` books of `entries` entries."""
    tok = llm.tokenizer
    prompts, answers = [], []
    for q in range(queries):
        ex = phonebook(entries, digits=digits, seed=seed * 1_000_003 + entries * 1009 + q)[0]
        if tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": ex.prompt.rstrip()}])
            ids = tok.encode(text, add_special_tokens=False)
        else:
            text = ex.prompt
            ids = tok.encode(text)
        prompts.append({"prompt": text, "prompt_token_ids": ids})
        answers.append(ex.answer)
    return prompts, answers


def phonebook_curve(llm, sizes: list[int], *, queries: int = 16, seed: int = 0, digits: int = 4,
                    progress: Callable[[int], None] | None = None) -> list[dict]:
    """One row per book size (ROW_KEYS); `progress(entries)` after each size."""
    from kvstate.cache.spec import cache_spec
    from kvstate.engine.params import SamplingParams
    from kvstate.errors import KvstateError

    if llm.tokenizer is None:
        raise KvstateError("the phonebook test needs a checkpoint with a tokenizer.json")
    spec = cache_spec(llm.plan, kv_dtype="float32", state_dtype="float32", conv_dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=digits + REPLY_TOKENS)
    rows = []
    for entries in sizes:
        prompts, answers = phonebook_prompts(llm, entries, queries, seed=seed, digits=digits)
        too_long = max(len(p["prompt_token_ids"]) for p in prompts) + params.max_tokens
        if too_long > llm.max_model_len:
            raise KvstateError(f"a {entries}-entry book needs {too_long} tokens, more than the model's "
                               f"{llm.max_model_len}")
        outputs = llm.generate(prompts, params)
        right = sum(first_number(o.text) == a for a, o in zip(answers, outputs))
        tokens = round(sum(len(p["prompt_token_ids"]) for p in prompts) / len(prompts))
        rows.append({"entries": entries, "prompt_tokens": tokens, "accuracy": right / len(prompts),
                     "kv_bytes": spec.kv_bytes_per_token * tokens, "state_bytes": spec.state_bytes})
        if progress is not None:
            progress(entries)
    return rows


def plot_curve(curves: dict[str, list[dict]], path: str) -> None:
    """Accuracy against book size, one line per model, with each model's state bytes in its label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, rows in curves.items():
        kib = rows[0]["state_bytes"] / 1024 if rows else 0
        ax.plot([r["entries"] for r in rows], [100 * r["accuracy"] for r in rows], marker="o",
                label=f"{name} (state {kib:.0f} KiB; KV {rows[-1]['kv_bytes'] / 1024:.0f} KiB at "
                      f"{rows[-1]['entries']} entries)" if rows else name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("phone book entries")
    ax.set_ylabel("exact answers (%)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Phonebook recall through the kvstate engine (greedy)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
