"""Prompt lookup (n-gram) drafting, no model and no torch.

The drafts for a request are the tokens that followed the latest earlier occurrence of its last
n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`, longest match first), in its
prompt and output so far: text that repeats its context (code edits, quotes, summaries) drafts
itself. As a distribution the draft is one-hot, which the rejection sampler relies on.
"""

from __future__ import annotations

from kvstate.engine.speculative.drafter import Drafter


class NgramDrafter(Drafter):
    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        self.min, self.max = prompt_lookup_min, prompt_lookup_max

    def propose(self, requests: list[tuple[object, int]]) -> list[list[int]]:
        """requests: (sequence, most drafts wanted) -> drafts per request (maybe fewer, or none)."""
        return [self.lookup(seq.token_ids(0, seq.num_tokens), k) if k > 0 else [] for seq, k in requests]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens following the latest earlier occurrence of the longest matching suffix."""
        n_tok = len(tokens)
        for n in range(min(self.max, n_tok - 1), self.min - 1, -1):
            suffix = tokens[n_tok - n:]
            # latest start s < n_tok - n with tokens[s:s+n] == suffix (scanning back from the end)
            for s in range(n_tok - n - 1, -1, -1):
                if tokens[s] == suffix[0] and tokens[s:s + n] == suffix:
                    return tokens[s + n : s + n + k]
        return []
