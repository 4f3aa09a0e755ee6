"""`kvstate memory [MODEL ...]`: per-request KV and fixed-state bytes of hybrid models (torch-free).

MODEL is a bundled short name, a config.json or a checkpoint directory; none means every
bundled model. Tables for humans (rich), `--json` for exact bytes, `--plot` for a chart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvstate.terminal.arg_types import count_arg

HELP_EPILOG = """\
layers: A attention, L MLA, G Gated DeltaNet, K KDA, M Mamba-2, S Mamba-1, C short conv,
        - block without a mixer (MLP/MoE), H several mixers in one block; ratio = state : KV layers.
token counts: 8k = 8192, 1m = 1048576. sizes: 80GiB = 80G = 80 x 2^30 B, 80GB = 80 x 10^9 B."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = HELP_EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help="bundled name, config.json or checkpoint directory (default: all bundled models)")
    parser.add_argument("--context", default="8k,128k,256k",
                        help="context lengths in tokens, comma-separated (default: 8k,128k,256k; k = 1024)")
    parser.add_argument("--batch", type=count_arg, default=1, help="concurrent requests for the totals (default: 1)")
    parser.add_argument("--kv-dtype", help="KV cache dtype (default: the model dtype)")
    parser.add_argument("--state-dtype", help="recurrent state dtype (default: mamba_ssm_dtype or float32)")
    parser.add_argument("--conv-dtype", help="conv window dtype (default: the model dtype)")
    parser.add_argument("--conv-window", choices=("kernel", "kernel-1"), default="kernel",
                        help="conv columns kept per request: kernel (transformers, default) or kernel-1 (vLLM)")
    parser.add_argument("--layers", action="store_true", help="per-layer breakdown and a layer bar")
    parser.add_argument("--json", action="store_true", help="exact byte counts as JSON")
    parser.add_argument("--snapshots", type=count_arg, metavar="N",
                        help="also show what N prefix-cache snapshots cost (a state slot each, at most one "
                             "partial KV block of --block-size tokens each); --snapshot-memory bounds them in serve")
    parser.add_argument("--block-size", type=count_arg, default=16,
                        help="tokens per KV block, for --snapshots (default 16)")
    parser.add_argument("--gpu-memory", metavar="SIZE",
                        help="GPU memory, e.g. 80GiB: requests that fit after the weights, longest context")
    parser.add_argument("--plot", metavar="FILE", help="write a log-log chart of cache vs context (.png or .svg)")
    parser.add_argument("--tp", type=count_arg, default=1, metavar="N",
                        help="tensor parallelism over N devices: per-device weights, KV per token and state; "
                             "one line per model where a head count does not divide by N")


def _load(args: argparse.Namespace):
    from kvstate.cache.spec import cache_spec
    from kvstate.config.reader import bundled_names
    from kvstate.families import read_plan
    from kvstate.memory import parse_contexts

    contexts = parse_contexts(args.context)
    models = []
    for source in args.models or bundled_names():
        plan = read_plan(source)
        if args.tp != 1:
            from kvstate.parallel.plan import shard_plan, tp_problems

            problems = tp_problems(plan, args.tp)
            if problems:  # one line: what does not divide
                print(f"{plan.name}: not sharded over --tp {args.tp}: {'; '.join(problems)}", file=sys.stderr)
                continue
            plan = shard_plan(plan, args.tp)  # rank 0: the most vocabulary rows, so the largest device
        spec = cache_spec(plan, kv_dtype=args.kv_dtype, state_dtype=args.state_dtype,
                          conv_dtype=args.conv_dtype, conv_window=args.conv_window)
        models.append((source, plan, spec))
    return contexts, models


def run(args: argparse.Namespace) -> int:
    from kvstate.cache.spec import ENGINE_POOL_DTYPES
    from kvstate.memory import fit, parse_size, snapshot_bytes, summary

    contexts, models = _load(args)
    if not models:
        return 2  # every model asked for failed to shard (each said why in one line)
    gpu = parse_size(args.gpu_memory) if args.gpu_memory else None
    fits = [fit(plan, spec, gpu, contexts, source if os.path.isdir(source) and args.tp == 1 else None) if gpu else None
            for source, plan, spec in models]
    chart = None
    if args.plot:
        from kvstate.memory_plot import plot

        chart = plot([(p, s) for _, p, s in models], args.plot, contexts)
    if args.json:
        out = []
        for (_, plan, spec), f in zip(models, fits):
            obj = summary(plan, spec, contexts, args.batch)
            obj["engine_pool_dtypes"] = dict(ENGINE_POOL_DTYPES)  # what kvstate's engine itself allocates
            if args.tp != 1:  # per device: the rank plan's parameters, KV and state
                obj.update(tp=args.tp, weight_bytes_per_device=_weight_bytes(plan))
            if f:
                obj["gpu"] = f.as_json()
            if plan.mtp:
                obj["mtp_kv_bytes_per_token"] = _mtp_kv_bytes(args, plan, spec)
            if args.layers:
                obj["per_layer"] = [e.to_json() for e in spec.entries]
            if args.snapshots:
                obj["snapshots"] = snapshot_bytes(spec, args.snapshots, args.block_size)
            out.append(obj)
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        if chart:
            print(f"wrote {chart}", file=sys.stderr)
        return 0
    _print_tables(args, contexts, models, fits, chart)
    return 0


def _mtp_kv_bytes(args, plan, spec) -> int:
    """KV bytes per token the MTP block adds when the engine drafts with it (`--speculative-mtp`)."""
    from kvstate.cache.spec import cache_spec

    with_mtp = cache_spec(plan, kv_dtype=args.kv_dtype, state_dtype=args.state_dtype, conv_dtype=args.conv_dtype,
                          conv_window=args.conv_window, mtp=True)
    return with_mtp.kv_bytes_per_token - spec.kv_bytes_per_token


def _weight_bytes(plan) -> int:
    from kvstate.config.dtypes import dtype_bytes

    return plan.params.total * dtype_bytes(plan.dtype)


# ---- human output -------------------------------------------------------------------------------

_ORDER = ("attention", "mla", "gated_deltanet", "kda", "mamba2", "mamba1", "short_conv", "none")
_COLORS = {"A": "bold red", "L": "bold magenta", "G": "green", "K": "cyan", "M": "blue", "S": "yellow",
           "C": "bright_black", "H": "bold yellow", "-": "dim"}


def _layers_text(plan) -> tuple[str, str]:
    """("6 A + 18 G", "3:1"): counts by mixer letter, and state mixers : KV mixers."""
    from kvstate.config.plan import KV_KINDS, LETTERS, NO_MIXER

    counts = plan.mixer_counts
    text = " + ".join(f"{counts[k]} {LETTERS.get(k, NO_MIXER)}" for k in _ORDER if counts.get(k))
    kv = sum(n for k, n in counts.items() if k in KV_KINDS)
    state = sum(n for k, n in counts.items() if k not in KV_KINDS and k != "none")
    if not kv or not state:
        return text, "-"
    r = state / kv
    return text, (f"{r:.0f}:1" if r == int(r) else f"{r:.1f}:1")


def _bar(plan):
    from rich.text import Text

    bar = Text()
    for letter in plan.layer_string:
        bar.append(letter, style=_COLORS.get(letter, ""))
    return bar


def _print_tables(args, contexts, models, fits, chart) -> None:
    from rich.table import Table

    from kvstate.terminal.console import make_console
    from kvstate.memory import format_bytes as fb
    from kvstate.memory import format_tokens

    console = make_console()
    times = f" x{args.batch}" if args.batch > 1 else ""
    per = f" per device (--tp {args.tp})" if args.tp != 1 else ""
    table = Table(title="Cache per request" + per + (f" (totals for {args.batch} requests)" if times else ""),
                  title_justify="left")
    cols = ("model", "layers", "ratio") + (("weights",) if per else ()) + ("KV / token", "recurrent", "conv",
                                                                         "fixed state", "dtypes")
    for col in cols:
        table.add_column(col, justify="left" if col in ("model", "layers", "dtypes") else "right")
    for c in contexts:
        table.add_column(format_tokens(c) + times, justify="right")
    beyond = False
    for _, plan, spec in models:
        layers, ratio = _layers_text(plan)
        dtypes = f"kv {spec.kv_dtype}, state {spec.state_dtype}"
        totals = []
        for c in contexts:
            over = plan.max_position_embeddings is not None and c > plan.max_position_embeddings
            beyond |= over
            totals.append(fb(args.batch * spec.request_bytes(c)) + (" *" if over else ""))
        weights = (fb(_weight_bytes(plan)),) if per else ()
        table.add_row(plan.name, layers, ratio, *weights, fb(spec.kv_bytes_per_token), fb(spec.recurrent_state_bytes),
                      fb(spec.conv_state_bytes), fb(spec.state_bytes), dtypes, *totals)
    notes = [f"conv window: {args.conv_window} columns"] + HELP_EPILOG.splitlines()[:2]
    notes += _engine_note(models)
    if beyond:
        notes.append("* longer than the model's max_position_embeddings")
    if args.snapshots:
        from kvstate.memory import snapshot_bytes

        for _, plan, spec in models:
            s = snapshot_bytes(spec, args.snapshots, args.block_size)
            notes.append(f"{plan.name}: {args.snapshots} prefix-cache snapshot{'s' * (args.snapshots != 1)}: "
                         f"{fb(s['state_bytes'])} of state slots + up to {fb(s['partial_kv_bytes_max'])} of partial "
                         f"KV blocks ({args.block_size} tokens) = at most {fb(s['total_bytes_max'])}")
    for _, plan, spec in models:
        if plan.mtp:
            notes.append(f"{plan.name}: its MTP block adds {fb(_mtp_kv_bytes(args, plan, spec))} KV / token "
                         f"when drafting with it (--speculative-mtp)")
    console.print(table)
    for note in notes:
        console.print(note, style="dim", soft_wrap=True)
    if args.layers:
        for _, plan, spec in models:
            _print_layers(console, plan, spec)
    if any(fits):
        _print_fits(console, models, fits, contexts)
    if chart:
        console.print(f"wrote {chart}")


def _engine_note(models) -> list[str]:
    """A line where the table's KV or state dtype differs from what kvstate's own engine allocates."""
    from kvstate.cache.spec import ENGINE_POOL_DTYPES as pools

    if all(s.kv_dtype == pools["kv"] and s.state_dtype == pools["state"] for _, _, s in models):
        return []
    kv = sorted({s.kv_dtype for _, _, s in models if s.kv_dtype != pools["kv"]})
    more = f" (2x the KV above in {kv[0]})" if kv == ["bfloat16"] or kv == ["float16"] else ""
    return [f"kvstate's own engine (generate, serve, bench) keeps KV in {pools['kv']} and states in "
            f"{pools['state']} on CPU{more}; --kv-dtype {pools['kv']} shows its figures"]


def _print_layers(console, plan, spec) -> None:
    from rich.table import Table

    from kvstate.memory import format_bytes as fb

    console.print()
    console.print(f"[bold]{plan.name}[/bold]  ", _bar(plan))
    table = Table(show_edge=False, pad_edge=False)
    for col in ("layer", "mixer", "ffn", "KV / token", "recurrent state", "conv window", "fixed bytes"):
        table.add_column(col, justify="right" if col in ("layer", "KV / token", "fixed bytes") else "left")
    by_layer: dict[int, list] = {}
    for e in spec.entries:
        by_layer.setdefault(e.layer, []).append(e)
    for layer in plan.layers:
        entries = by_layer.get(layer.index, [])
        shape = lambda t: "" if t is None else f"{list(t.shape)} {t.dtype}"  # noqa: E731
        table.add_row(str(layer.index), " + ".join(layer.kinds) or "-", layer.ffn.kind,
                      fb(sum(e.kv_bytes_per_token for e in entries)),
                      ", ".join(shape(e.recurrent) for e in entries if e.recurrent),
                      ", ".join(shape(e.conv) for e in entries if e.conv),
                      fb(sum(e.state_bytes for e in entries)))
    console.print(table)


def _print_fits(console, models, fits, contexts) -> None:
    from rich.table import Table

    from kvstate.memory import format_bytes as fb
    from kvstate.memory import format_tokens

    gpu = next(f for f in fits if f).gpu_bytes
    table = Table(title=f"Requests that fit in {fb(gpu)} after the weights", title_justify="left")
    for col in ("model", "parameters", "weights", "free for cache"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for c in contexts:
        table.add_column(f"requests @ {format_tokens(c)}", justify="right")
    table.add_column("longest context", justify="right")
    for (_, plan, _), f in zip(models, fits):
        weights = fb(f.weight_bytes) + {"safetensors": " (files)", "gguf": " (GGUF tensors)"}.get(f.weight_source,
                                                                                                   f" {plan.dtype}")
        if f.max_context is None:
            longest = "unbounded"
        else:
            longest = f"{f.max_context:,}" + (" (model limit)" if f.limited_by_model else "")
        table.add_row(plan.name, f"{plan.params.total / 1e9:.2f}B", weights,
                      fb(f.free_bytes) if f.free_bytes >= 0 else "weights do not fit",
                      *(f"{f.max_requests[c]:,}" for c in contexts), longest)
    console.print()
    console.print(table)
