"""`kvstate generate --model PATH "prompt"`: stream a completion, then a summary line.

The summary gives decode tokens/s, time to first token, and the cache bytes the request held
at its peak, KV blocks and state slots apart (the two kinds of cache of a hybrid model).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    parser.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--cache-memory", default=None, help="KV + state pool budget, e.g. 4GiB (default: a fraction of free RAM)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of streaming")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvstate.engine.llm import LLM
    from kvstate.engine.params import SamplingParams
    from kvstate.memory import format_bytes

    console = Console(stderr=True)
    with console.status("loading model"):
        llm = LLM(args.model, cache_memory=args.cache_memory, max_model_len=args.max_model_len, seed=args.seed)
    prompts = args.prompt
    if args.chat:
        if llm.tokenizer is None:
            from kvstate.errors import KvstateError

            raise KvstateError(f"{args.model}: --chat needs a tokenizer.json")
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompts = [llm.tokenizer.apply_chat_template(system + [{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed, stop=args.stop, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    outputs = []
    for ev in llm.stream(prompts, params):
        if ev.finished:
            outputs.append(ev.output)
        elif not args.json and len(prompts) == 1:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
    elapsed = time.perf_counter() - start
    peak = llm.peak_cache_bytes
    if args.json:
        for o in outputs:
            print(json.dumps(dict(prompt=o.prompt, token_ids=o.token_ids, text=o.text, finish_reason=o.finish_reason,
                                  error=o.error, metrics=o.metrics, peak_cache_bytes=peak)))
        return 0 if all(o.error is None for o in outputs) else 2
    if len(prompts) > 1:
        for o in outputs:
            print(o.text if o.error is None else f"[error: {o.error}]")
    else:
        print()
    for o in outputs:
        if o.error:
            console.print(f"[red]error:[/] {o.error}")
    n = sum(len(o.token_ids) for o in outputs)
    tpot = [o.metrics.get("time_per_output_token") for o in outputs if o.metrics.get("time_per_output_token")]
    ttft = [o.metrics.get("time_to_first_token") for o in outputs if o.metrics.get("time_to_first_token") is not None]
    decode = f"{1 / (sum(tpot) / len(tpot)):.1f} tok/s decode" if tpot else "-"
    console.print(f"[dim]{n} tokens in {elapsed:.2f} s: {decode}, first token {1000 * min(ttft, default=0):.0f} ms; "
                  f"cache in use at peak: KV {format_bytes(peak['kv'])} + state {format_bytes(peak['state'])} "
                  f"({outputs[0].finish_reason if outputs else '-'})[/]", soft_wrap=True)
    return 0 if all(o.error is None for o in outputs) else 2
