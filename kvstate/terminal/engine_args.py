"""Command-line options shared by the commands that run the engine (generate, serve, the benchmarks):
one option per `EngineConfig` field they name, its flags and help from the field (kvstate.engine.config),
and the speculative decoding flags that make its speculative_config."""

from __future__ import annotations

import argparse
import json

from kvstate.terminal.arg_types import count_arg, seed_arg, whole_number
from kvstate.errors import KvstateError


def weight_dtype_arg(text: str) -> str:
    """--weight-dtype: bf16 or fp32 in any spelling `kvstate memory` takes, or a quantized one (int8,
    q8_0, q4_0, q4_k), as its canonical name."""
    from kvstate.config.dtypes import WEIGHT_DTYPES, WEIGHT_DTYPES_EXPECTED, canonical_weight_dtype

    name = canonical_weight_dtype(text)
    if name not in WEIGHT_DTYPES:
        raise argparse.ArgumentTypeError(f"{WEIGHT_DTYPES_EXPECTED}, got {text!r}")
    return name


def interval_arg(text: str):
    """--snapshot-interval: a token count or 'auto'."""
    return "auto" if text == "auto" else count_arg(text)


def activation_dtype_arg(text: str) -> str:
    """--activation-dtype: fp32, bf16, bf16x3 or q8."""
    from kvstate.engine.config import ACTIVATION_DTYPES

    if text not in ACTIVATION_DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(ACTIVATION_DTYPES)}, got {text!r}")
    return text


# the argparse type of each engine setting on the command line (a bool is a switch, a str as given)
ARG_TYPES = {"block_size": count_arg, "max_num_seqs": count_arg, "max_num_batched_tokens": count_arg,
             "max_model_len": count_arg, "seed": seed_arg, "snapshot_interval": interval_arg,
             "num_snapshot_slots": whole_number(0), "prefix_align": count_arg, "weight_dtype": weight_dtype_arg,
             "activation_dtype": activation_dtype_arg, "tensor_parallel_size": count_arg}


def add_engine_args(parser, names: tuple[str, ...]) -> None:
    """An option for each named `EngineConfig` field, its flags and help from the field's metadata."""
    from kvstate.engine.config import SETTINGS

    for name in names:
        f, meta = SETTINGS[name], SETTINGS[name].metadata
        flags = meta["flags"] or ("--" + name.replace("_", "-"),)
        text = meta["help"].replace("%", "%%")  # argparse expands %(...)s in help: a literal % must be doubled
        if f.default is False:
            parser.add_argument(*flags, dest=name, action="store_true", help=text)
            continue
        shown = meta["shown"] or f.default
        parser.add_argument(*flags, dest=name, type=ARG_TYPES.get(name, str), default=f.default,
                            metavar=meta["metavar"], help=f"{text} (default: {shown})")


def engine_config(args: argparse.Namespace, names: tuple[str, ...]) -> dict:
    """The EngineConfig fields of the parsed options `names` (as `LLM(model, **fields)` takes them),
    speculative decoding's flags included."""
    fields = {name: getattr(args, name) for name in names}
    return {**fields, "speculative_config": speculative_config(args)}


def add_weight_dtype(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser, ("weight_dtype",))


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    """--speculative-ngram, -mtp, -model, -tokens, -config (read by `speculative_config`); the old
    --spec-* spellings stay as hidden aliases for one release."""
    group = parser.add_argument_group("speculative decoding (greedy output unchanged; sampling keeps its distribution)")
    for name, kind, default, metavar, text in (
            ("ngram", count_arg, None, "K", "draft K tokens per step by prompt lookup (the continuation of the "
                                            "last n-gram's latest earlier occurrence)"),
            ("mtp", count_arg, None, "K", "draft K tokens per step with the checkpoint's own multi-token-"
                                          "prediction head (mtp.* of Qwen3.5 / Qwen3-Next; K of 1-3)"),
            ("model", str, None, "PATH", "draft with this smaller checkpoint of the same vocabulary (K from "
                                         "--speculative-tokens)"),
            ("tokens", count_arg, 4, "K", "tokens the draft model proposes per step (default: 4)")):
        dest = f"speculative_{name}"
        group.add_argument(f"--speculative-{name}", dest=dest, type=kind, default=default, metavar=metavar, help=text)
        group.add_argument(f"--spec-{name}", dest=dest, type=kind, default=default, help=argparse.SUPPRESS)
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="vLLM's dict, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                            "\"prompt_lookup_max\": 4}'")


def speculative_config(args: argparse.Namespace) -> dict | None:
    """The speculative_config of the flags (at most one of them), or None."""
    given = [f"--speculative-{name}" for name in ("ngram", "mtp", "model", "config")
             if getattr(args, f"speculative_{name}") is not None]
    if len(given) > 1:
        raise KvstateError(f"{' and '.join(given)}: give one way of drafting")
    if args.speculative_ngram is not None:
        return {"method": "ngram", "num_speculative_tokens": args.speculative_ngram}
    if args.speculative_mtp is not None:
        return {"method": "mtp", "num_speculative_tokens": args.speculative_mtp}
    if args.speculative_model is not None:
        return {"model": args.speculative_model, "num_speculative_tokens": args.speculative_tokens}
    if args.speculative_config is not None:
        try:
            return json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise KvstateError(f"--speculative-config: not JSON ({e.msg} at character {e.pos})") from None
    return None
