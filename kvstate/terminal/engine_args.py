"""Command-line options shared by the commands that run the engine (generate, serve, the benchmarks):
argument types, the weight dtype, the cache budget and length, speculative decoding, tensor parallelism."""

from __future__ import annotations

import argparse
import json

from kvstate.terminal.arg_types import count_arg
from kvstate.errors import KvstateError


def weight_dtype_arg(text: str) -> str:
    """--weight-dtype: bf16 or fp32 in any spelling `kvstate memory` takes, or a quantized one (int8,
    q8_0, q4_0, q4_k), as its canonical name."""
    from kvstate.config.dtypes import WEIGHT_DTYPES, WEIGHT_DTYPES_EXPECTED, canonical_weight_dtype

    name = canonical_weight_dtype(text)
    if name not in WEIGHT_DTYPES:
        raise argparse.ArgumentTypeError(f"{WEIGHT_DTYPES_EXPECTED}, got {text!r}")
    return name


def add_weight_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weight-dtype", type=weight_dtype_arg, default=None, metavar="DTYPE",
                        help="keep the weight matrices in bf16 or fp32, or the projections in int8 with per-row "
                             "scales, or in GGML's q8_0, q4_0 or q4_k blocks; math stays fp32 (default: the "
                             "checkpoint's)")


def add_tp_arg(parser: argparse.ArgumentParser) -> None:
    """--tp N: tensor parallelism over N processes (gloo on CPU, spawned on 127.0.0.1, or torchrun's)."""
    parser.add_argument("--tp", type=count_arg, default=1, metavar="N",
                        help="shard the model and its caches over N processes (tensor parallelism; default: 1); "
                             "--cache-memory is then per process")


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    """--cache-memory and --max-model-len."""
    parser.add_argument("--cache-memory", default=None, metavar="SIZE",
                        help="KV + state pool budget, e.g. 4GiB (default: a fraction of the free memory)")
    parser.add_argument("--max-model-len", type=count_arg, default=None, metavar="N",
                        help="longest prompt + output in tokens, at most the model's (default: the model's "
                             "max_position_embeddings)")


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    """--spec-ngram, --spec-mtp, --spec-model, --spec-tokens, --speculative-config (read by `speculative_config`)."""
    spec = parser.add_argument_group("speculative decoding (greedy output unchanged; sampling keeps its distribution)")
    spec.add_argument("--spec-ngram", type=count_arg, default=None, metavar="K",
                      help="draft K tokens per step by prompt lookup (the continuation of the last n-gram's "
                           "latest earlier occurrence)")
    spec.add_argument("--spec-mtp", type=count_arg, default=None, metavar="K",
                      help="draft K tokens per step with the checkpoint's own multi-token-prediction head "
                           "(mtp.* of Qwen3.5 / Qwen3-Next; K of 1-3)")
    spec.add_argument("--spec-model", default=None, metavar="PATH",
                      help="draft with this smaller checkpoint of the same vocabulary (K from --spec-tokens)")
    spec.add_argument("--spec-tokens", type=count_arg, default=4, metavar="K",
                      help="tokens the draft model proposes per step (default: 4)")
    spec.add_argument("--speculative-config", default=None, metavar="JSON",
                      help="vLLM's dict, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                           "\"prompt_lookup_max\": 4}'")


def speculative_config(args: argparse.Namespace) -> dict | None:
    """The speculative_config of the flags (at most one of them), or None."""
    given = [f for f, v in (("--spec-ngram", args.spec_ngram), ("--spec-mtp", args.spec_mtp),
                            ("--spec-model", args.spec_model),
                            ("--speculative-config", args.speculative_config)) if v is not None]
    if len(given) > 1:
        raise KvstateError(f"{' and '.join(given)}: give one way of drafting")
    if args.spec_ngram is not None:
        return {"method": "ngram", "num_speculative_tokens": args.spec_ngram}
    if args.spec_mtp is not None:
        return {"method": "mtp", "num_speculative_tokens": args.spec_mtp}
    if args.spec_model is not None:
        return {"model": args.spec_model, "num_speculative_tokens": args.spec_tokens}
    if args.speculative_config is not None:
        try:
            return json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise KvstateError(f"--speculative-config: not JSON ({e.msg} at character {e.pos})") from None
    return None
