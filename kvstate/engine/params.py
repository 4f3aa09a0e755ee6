"""SamplingParams: how one request is decoded and when it stops (no torch).

Field names and meanings follow vLLM's `SamplingParams`, which users already know:

    temperature     0 (below 1e-5, as vLLM) = greedy argmax; otherwise logits / temperature
    top_k           keep the k most likely tokens; 0 or -1 = off
    top_p           keep the smallest set of most likely tokens whose mass reaches top_p; 1 = off
    min_p           drop tokens less likely than min_p * p(most likely token); 0 = off
    seed            per-request random generator (reproducible whatever the batch around it)
    stop            strings that end the output (not included in the text)
    stop_token_ids  token ids that end the output (included in token_ids)
    max_tokens      most tokens to generate (None = up to the model's maximum length); 0 only
                    with prompt_logprobs (score the prompt, generate nothing)
    ignore_eos      keep generating past the end-of-sequence token
    logprobs        None = none; n >= 0 = the chosen token's logprob plus the n most likely
    prompt_logprobs None = none; k >= 0 = each prompt token's logprob (and rank) given the tokens
                    before it, plus the k most likely there (RequestOutput.prompt_logprobs)
    n               samples per prompt (sample k uses seed + k when a seed is given, as vLLM)
    presence_penalty    subtract it from the logit of every token already in the output
    frequency_penalty   subtract it times the token's count in the output
    repetition_penalty  tokens in the prompt or output: logit / p if positive, logit * p if not
                        (transformers' RepetitionPenaltyLogitsProcessor); 1 = off

Penalties act on the raw logits (greedy rows too), then filters run in vLLM's order:
temperature, min_p, top_k, top_p. Invalid values raise KvstateError (a ValueError) naming the
field. `SamplingParams.coerce` also takes a dict of fields (or None for the defaults).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, fields, replace

from kvstate.errors import KvstateError

GREEDY_EPS = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
# Bounds on the work one request adds per generated token: each token is looked up in the stop ids
# (a set) and each stop string is searched in the new text and held back by its prefixes.
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# Sampling runs in float32: a top_p or repetition_penalty below its smallest normal number rounds
# to 0 there (every token masked), one above its largest to inf.
FLOAT32_TINY, FLOAT32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38


def _int(name: str, value, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        raise KvstateError(f"SamplingParams.{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise KvstateError(f"SamplingParams.{name} must be an integer, got {value!r}") from None


def _float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise KvstateError(f"SamplingParams.{name} must be a number, got {value!r}")
    out = float(value)
    if math.isnan(out):
        raise KvstateError(f"SamplingParams.{name} must be a number, got nan")
    return out


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "SamplingParams":
        """Check and normalize every field in place (stop -> list, top_k -1 -> 0); returns self."""
        self.temperature = _float("temperature", self.temperature)
        if not (0.0 <= self.temperature < math.inf):
            raise KvstateError(f"SamplingParams.temperature must be >= 0 and finite, got {self.temperature}")
        self.top_k = _int("top_k", self.top_k)
        if self.top_k < -1:
            raise KvstateError(f"SamplingParams.top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")
        self.top_k = max(self.top_k, 0)
        self.top_p = _float("top_p", self.top_p)
        if not (FLOAT32_TINY <= self.top_p <= 1.0):
            raise KvstateError(f"SamplingParams.top_p must be in (0, 1] and at least {FLOAT32_TINY:.3g} "
                               f"(less underflows float32), got {self.top_p}")
        self.min_p = _float("min_p", self.min_p)
        if not (0.0 <= self.min_p <= 1.0):
            raise KvstateError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        self.seed = _int("seed", self.seed, allow_none=True)
        self.stop = self._stop_strings(self.stop)
        self.stop_token_ids = self._stop_token_ids(self.stop_token_ids)
        self.stop_token_set = frozenset(self.stop_token_ids)  # what the scheduler looks each token up in
        self.max_tokens = _int("max_tokens", self.max_tokens, allow_none=True)
        self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, allow_none=True)
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise KvstateError(f"SamplingParams.prompt_logprobs must be >= 0 (or None), got {self.prompt_logprobs}")
        least = 0 if self.prompt_logprobs is not None else 1  # max_tokens 0: score the prompt only (vLLM)
        if self.max_tokens is not None and self.max_tokens < least:
            what = ">= 0 (or None)" if least == 0 else ">= 1 (or None; 0 only with prompt_logprobs)"
            raise KvstateError(f"SamplingParams.max_tokens must be {what}, got {self.max_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise KvstateError(f"SamplingParams.ignore_eos must be True or False, got {self.ignore_eos!r}")
        self.logprobs = _int("logprobs", self.logprobs, allow_none=True)
        if self.logprobs is not None and self.logprobs < 0:
            raise KvstateError(f"SamplingParams.logprobs must be >= 0 (or None), got {self.logprobs}")
        self.n = _int("n", self.n)
        if self.n < 1:
            raise KvstateError(f"SamplingParams.n must be >= 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise KvstateError(f"SamplingParams.{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:
            raise KvstateError(f"SamplingParams.repetition_penalty must be > 0 and in [{FLOAT32_TINY:.3g}, "
                               f"{FLOAT32_MAX:.3g}] (float32), got {self.repetition_penalty}")
        return self

    @classmethod
    def coerce(cls, value) -> "SamplingParams":
        """A SamplingParams from itself (validated again), a dict of its fields, or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value.validate()
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(str(k) for k in value if k not in known)
            if unknown:
                raise KvstateError(f"SamplingParams has no field {unknown[0]!r}")
            return cls(**value)
        raise KvstateError(f"sampling params must be SamplingParams or a dict, got {type(value).__name__}")

    def for_sample(self, k: int) -> "SamplingParams":
        """The params of sample k of n: one sample, seed + k when seeded (vLLM's rule)."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + k)

    @staticmethod
    def _stop_token_ids(ids) -> list[int]:
        ids = [] if ids is None else ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise KvstateError(f"SamplingParams.stop_token_ids must be a list of integers, got {ids!r}")
        if hasattr(ids, "__len__") and len(ids) > MAX_STOP_TOKEN_IDS:  # before converting a million of them
            raise KvstateError(f"SamplingParams.stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        ids = [_int("stop_token_ids", t) for t in ids]
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise KvstateError(f"SamplingParams.stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        if any(t < 0 for t in ids):
            raise KvstateError(f"SamplingParams.stop_token_ids must be >= 0, got {ids[:8]}")
        return ids

    @staticmethod
    def _stop_strings(stop) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not hasattr(items, "__iter__"):
            raise KvstateError(f"SamplingParams.stop must be a string or a list of strings, got {stop!r}")
        items = list(items)
        for s in items:
            if not isinstance(s, str) or not s:
                raise KvstateError(f"SamplingParams.stop must hold non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_CHARS:
                raise KvstateError(f"SamplingParams.stop strings have at most {MAX_STOP_CHARS} characters, "
                                   f"got one of {len(s)}")
        items = list(dict.fromkeys(items))  # each string once: every one is searched at every token
        if len(items) > MAX_STOP_STRINGS:
            raise KvstateError(f"SamplingParams.stop takes at most {MAX_STOP_STRINGS} strings, got {len(items)}")
        return items

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def filters(self) -> bool:
        """Whether any of min_p, top_k, top_p changes the distribution."""
        return self.min_p > 0 or self.top_k > 0 or self.top_p < 1

    @property
    def penalties(self) -> bool:
        """Whether any penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
