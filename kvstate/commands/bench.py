"""`kvstate bench <what>`: benchmarks that print ratios against a reference run in the same process."""

from __future__ import annotations

import argparse
import importlib

from kvstate.terminal.arg_types import count_arg

# what -> (module in kvstate.bench, help). Each module has configure(parser) and run(args).
BENCHES: dict[str, tuple[str, str]] = {
    "ops": ("kvstate.bench.ops", "every op and form: ms, tokens/s, GFLOP/s, ratio to transformers"),
    "model": ("kvstate.bench.model", "prefill of a ~0.5B Qwen3.5-style checkpoint vs transformers"),
    "engine": ("kvstate.bench.engine", "engine decode at batch 1/8/32 and prefill vs transformers generate()"),
    "linear": ("kvstate.bench.linear", "decode-sized linears: kvstate's CPU kernels vs F.linear, fp32/bf16 weights"),
    "prefix": ("kvstate.bench.prefix",
               "prefix caching per snapshot policy: shared documents, repeats, system prompts, chats"),
    "speculative": ("kvstate.bench.speculative",
                    "speculative decoding: acceptance and batch-1 decode tok/s, k = 2/4/8, 3 drafters"),
    "prompt-logprobs": ("kvstate.bench.prompt_logprobs",
                        "a prompt scored (prompt_logprobs=1) vs the same prompt prefilled, 0.5B checkpoint"),
    "tp": ("kvstate.bench.tp", "tensor parallelism: prefill and decode tok/s, TP 1 (N threads) vs TP N (N x 1 thread)"),
}
ALIASES = {"speculative": ["spec"]}  # old names, kept for one release


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="<what>", required=True)
    for name, (module_name, help_text) in BENCHES.items():
        p = sub.add_parser(name, help=help_text, description=help_text, aliases=ALIASES.get(name, []))
        p.add_argument("--json", action="store_true", help="print machine-readable results")
        p.add_argument("--threads", type=count_arg, default=None, help="torch threads (default: all cores)")
        p.set_defaults(_bench_module=module_name)
        # The bench module's own options; its import must stay light (no torch at module level).
        importlib.import_module(module_name).configure(p)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(args._bench_module).run(args)
