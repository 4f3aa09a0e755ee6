"""`kvstate generate [--model PATH_OR_HUB_ID_OR_NAME] "prompt"`: stream a completion, then a summary line.

Without --model it runs the shipped kvstate-phonebook-hybrid (kvstate.shipped).

The summary gives decode tokens/s, time to first token, and the cache bytes the requests held
at their peak, KV blocks and state slots apart (the two kinds of cache of a hybrid model), and
how the requests finished. A prompt `-` is read from stdin.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections import Counter

from kvstate.terminal.arg_types import count_arg, whole_number
from kvstate.terminal.engine_args import add_engine_args, add_speculative_args, engine_config
from kvstate.errors import KvstateError, UnknownTokenWarning


# the EngineConfig fields generate takes as options (kvstate.engine.config documents each)
ENGINE_ARGS = ("seed", "cache_memory", "max_model_len", "tensor_parallel_size", "enable_prefix_caching", "weight_dtype",
               "activation_dtype")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+",
                        help="prompt text; several prompts run as one batch; - reads a prompt from stdin")
    parser.add_argument("--model", default=None, metavar="PATH_OR_HUB_ID",
                        help="checkpoint directory (config.json, *.safetensors, tokenizer.json), a Hugging Face "
                             "hub id (org/name: the local cache when offline, else downloaded) or a shipped "
                             "model's name (default: kvstate-phonebook-hybrid)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap each prompt as a user message in the checkpoint's chat template")
    parser.add_argument("--system", default=None, metavar="TEXT",
                        help="system message of the chat template (needs --chat)")
    parser.add_argument("--max-tokens", type=count_arg, default=64, metavar="N",
                        help="most tokens to generate per prompt (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="sampling temperature; 0 = greedy (default: 0)")
    parser.add_argument("--top-k", type=whole_number(0), default=0, metavar="K",
                        help="keep the k most likely tokens; 0 = off (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="keep the smallest set of tokens with this total probability; 1 = off (default: 1)")
    parser.add_argument("--min-p", type=float, default=0.0, metavar="P",
                        help="drop tokens less likely than this times the top one; 0 = off (default: 0)")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="stop when the output contains this string, which is left out (repeatable)")
    parser.add_argument("--stop-token-id", action="append", type=whole_number(0), default=None, metavar="ID",
                        dest="stop_token_ids",
                        help="stop after this token id, which is kept (repeatable; default: the tokenizer's EOS)")
    parser.add_argument("--n", type=count_arg, default=1, metavar="N",
                        help="samples per prompt; with a seed, sample k uses seed + k (default: 1)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                        help="subtract X from the logit of every token already in the output (default: 0)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                        help="subtract X times the token's count in the output (default: 0)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, metavar="X",
                        help="divide the positive logits of tokens seen in prompt or output by X, multiply the "
                             "negative ones; 1 = off (default: 1)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="keep generating past the end-of-sequence token (default: stop there)")
    add_engine_args(parser, ENGINE_ARGS)
    add_speculative_args(parser)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per prompt when done instead of streaming text")


def read_prompts(prompts: list[str], stdin=None) -> list[str]:
    """The prompts with each `-` replaced by the text of stdin (read once; its last newline dropped)."""
    if "-" not in prompts:
        return prompts
    stdin = stdin or sys.stdin
    if prompts.count("-") > 1:
        raise KvstateError("prompt: '-' (stdin) can be given once")
    text = stdin.read()
    text = text[:-1] if text.endswith("\n") else text
    if not text:
        raise KvstateError("prompt: '-' read an empty prompt from stdin")
    return [text if p == "-" else p for p in prompts]


def run(args: argparse.Namespace) -> int:
    from kvstate.terminal.console import make_console
    from kvstate.terminal.progress import load_progress
    from kvstate.llm import LLM
    from kvstate.engine.params import SamplingParams
    from kvstate.hub import resolve_checkpoint

    if args.system is not None and not args.chat:
        raise KvstateError("--system needs --chat (the system message is part of the chat template)")
    prompts = read_prompts(args.prompt)
    console = make_console(stderr=True)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed, stop=args.stop, stop_token_ids=args.stop_token_ids,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, n=args.n,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            repetition_penalty=args.repetition_penalty)
    from kvstate.shipped import DEFAULT_MODEL

    # a hub id -> its snapshot dir (weights and tokenizer); a shipped name -> its package dir
    model = resolve_checkpoint(args.model or DEFAULT_MODEL)
    with load_progress(console, enabled=not args.json) as progress:
        llm = LLM(model, load_progress=progress, **engine_config(args, ENGINE_ARGS))
    if args.chat:
        if llm.tokenizer is None:
            raise KvstateError(f"{args.model}: --chat needs a tokenizer.json")
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompts = [llm.tokenizer.apply_chat_template(system + [{"role": "user", "content": p}]) for p in prompts]
    start = time.perf_counter()
    outputs = []
    streaming = not args.json and len(prompts) == 1 and args.n == 1
    with warnings.catch_warnings(record=True) as caught:  # the prompts are tokenized here
        warnings.simplefilter("always", UnknownTokenWarning)
        events = llm.stream(prompts, params)
    _show_warnings(console, caught, model / "README.md")
    for ev in events:
        if ev.finished:
            outputs.append(ev.output)
        elif streaming:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
    elapsed = time.perf_counter() - start
    llm.close()  # tensor-parallel worker processes, if any
    peak = llm.peak_cache_bytes
    failed = any(o.error is not None for o in outputs)
    if args.json:
        _print_json(args, outputs, peak)
        return 2 if failed else 0
    _print_text(console, args, outputs, streaming)
    stats = llm.stats()
    console.print(f"[dim]{summary(outputs, elapsed, peak, stats)}[/]", soft_wrap=True)
    if stats.get("spec_num_draft_tokens") is not None:
        console.print(f"[dim]speculation: {stats['spec_num_accepted_tokens']} of {stats['spec_num_draft_tokens']} "
                      f"drafted tokens accepted ({100 * stats['spec_acceptance_rate']:.0f}%), "
                      f"{stats['spec_mean_accepted_length']:.2f} tokens per verify step[/]", soft_wrap=True)
    return 2 if failed else 0


def _show_warnings(console, caught, card) -> None:
    """Unknown-token warnings as one yellow line each (pointing at the model card); others re-raised."""
    for w in caught:
        if issubclass(w.category, UnknownTokenWarning):
            hint = f" (what this model knows: {card})" if card.is_file() else ""
            console.print(f"[yellow]warning:[/] {w.message}{hint}", soft_wrap=True, highlight=False)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _print_json(args, outputs, peak: dict) -> None:
    """One JSON line per prompt (--json)."""
    for o in outputs:
        row = dict(prompt=o.prompt, token_ids=o.token_ids, text=o.text, finish_reason=o.finish_reason,
                   error=o.error, metrics=o.metrics, peak_cache_bytes=peak, num_cached_tokens=o.num_cached_tokens)
        if args.n > 1:  # every sample; the fields above are the first one's
            row["outputs"] = [dict(text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason)
                              for c in o.outputs]
        print(json.dumps(row))


def _print_text(console, args, outputs, streaming: bool) -> None:
    """The replies not streamed already, then each error in red."""
    if not streaming:
        for o in outputs:
            if o.error is not None:
                print(f"[error: {o.error}]")
                continue
            for k, c in enumerate(o.outputs):
                print((f"[sample {k}] " if args.n > 1 else "") + c.text)
    elif outputs and outputs[0].error is None:
        print()
    for o in outputs:
        if o.error:
            console.print(f"[red]error:[/] {o.error}", soft_wrap=True)


def summary(outputs, elapsed: float, peak: dict[str, int], stats: dict | None = None) -> str:
    """"12 tokens in 0.41 s: 31.5 tok/s decode, first token 52 ms; cache in use at peak: KV 48 KiB +
    state 1.5 MiB (2 length, 1 stop)". Timings only from requests that produced them; every
    request's finish reason counted. With prefix caching (`stats` of `LLM.stats()`): "; prefix cache:
    40 of 52 prompt tokens cached (77%), 3 snapshots 4.50 MiB"."""
    from kvstate.memory import format_bytes

    samples = [c for o in outputs for c in (getattr(o, "outputs", None) or [o])]  # each of the n samples
    n = sum(len(c.token_ids) for c in samples)
    tpot = [t for o in outputs if (t := o.metrics.get("time_per_output_token"))]
    ttft = [t for o in outputs if (t := o.metrics.get("time_to_first_token")) is not None and o.token_ids]
    timings = []
    if tpot:
        timings.append(f"{1 / (sum(tpot) / len(tpot)):.1f} tok/s decode")
    if ttft:
        timings.append(f"first token {1000 * min(ttft):.0f} ms")
    head = f"{n} token{'s' * (n != 1)} in {elapsed:.2f} s" + (": " + ", ".join(timings) if timings else "")
    reasons = Counter(c.finish_reason or "unfinished" for c in samples)
    if len(samples) == 1:
        finish = next(iter(reasons))
    else:
        finish = ", ".join(f"{count} {reason}" for reason, count in reasons.most_common())
    line = (f"{head}; cache in use at peak: KV {format_bytes(peak['kv'])} + state {format_bytes(peak['state'])} "
            f"({finish or '-'})")
    if stats and "prefix_cached_tokens" in stats:
        line += (f"; prefix cache: {stats['prefix_cached_tokens']} of {stats['prefix_prompt_tokens']} prompt tokens "
                 f"cached ({100 * stats['prefix_hit_rate']:.0f}%), {stats['snapshots_held']} snapshot"
                 f"{'s' * (stats['snapshots_held'] != 1)} {format_bytes(stats['snapshot_bytes'])}")
    return line
