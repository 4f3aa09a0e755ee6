"""What an MTP head buys a shipped phonebook model: acceptance and batch-1 decode speed, per chat kind.

For phone-book chats (a book, one question) and copy chats ("Repeat this:"), each prompt is the
chat up to the assistant's turn; the reply is decoded greedily until <|im_end|>, once plainly and
once drafting with the head (k drafts a step), alternating request by request in one process
(a shared machine's load drifts). Decode time is a request's time minus the time of its first
token (prefill), measured the same way for both; replies are checked token for token.
"""

from __future__ import annotations

import time

import numpy as np

from kvstate.recall.chat_data import Chat, copy_chat, encode_chat, phonebook_chat


def prompts(tokenizer, kind: str, n: int, seed: int) -> list[list[int]]:
    """Token ids of `n` fresh chats of `kind` ("phonebook" of 4-12 entries, "copy" of 8-40 words), up to
    the assistant's turn."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        chat = phonebook_chat(rng, int(rng.integers(4, 13))) if kind == "phonebook" else \
            copy_chat(rng, int(rng.integers(8, 41)))
        ids, _ = encode_chat(tokenizer, Chat(chat.messages[:1], [], chat.kind))
        out.append(ids + tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False).ids)
    return out


def measure(path, k: int = 1, n: int = 12, seed: int = 7) -> list[dict]:
    """One row per chat kind: acceptance, tokens per verify step, decode tok/s plain and with the head."""
    from tokenizers import Tokenizer

    from kvstate.engine.params import SamplingParams
    from kvstate.hub import resolve_checkpoint
    from kvstate.llm import LLM

    plain = LLM(path, max_num_seqs=1, cache_memory="64MiB")
    mtp = LLM(path, max_num_seqs=1, cache_memory="64MiB",
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    tok = Tokenizer.from_file(str(resolve_checkpoint(path) / "tokenizer.json"))
    rows = []
    for kind in ("phonebook", "copy"):
        seconds = {"plain": 0.0, "mtp": 0.0}
        tokens, exact = 0, True
        before = mtp.engine.proposer.stats()
        for ids in prompts(tok, kind, n, seed):
            replies = {}
            for name, llm in (("plain", plain), ("mtp", mtp)):
                t0 = time.perf_counter()
                llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1))
                t1 = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=96))
                t2 = time.perf_counter()
                seconds[name] += max((t2 - t1) - (t1 - t0), 1e-9)
                replies[name] = out[0].outputs[0].token_ids
            exact &= replies["plain"] == replies["mtp"]
            tokens += len(replies["plain"]) - 1
        after = mtp.engine.proposer.stats()
        drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
        accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        steps = after["spec_num_drafts"] - before["spec_num_drafts"]
        rows.append(dict(kind=kind, k=k, chats=n, acceptance=accepted / max(drafted, 1),
                         tokens_per_step=1 + accepted / max(steps, 1), plain_tokens_per_s=tokens / seconds["plain"],
                         mtp_tokens_per_s=tokens / seconds["mtp"], speedup=seconds["plain"] / seconds["mtp"],
                         exact=exact))
    return rows
