"""`kvstate bench engine`: decode and prefill throughput of the engine against transformers' generate().

Same checkpoint and the same prompts on both sides, in one process: a random Qwen3.5-style one
(fp32) by default, or any checkpoint given with `--model PATH_OR_HUB_ID`. kvstate keeps its weight
matrices in `--weight-dtype` (default: the checkpoint's), activations fp32; transformers runs fp32.
Decode speed is measured the same way for both: the time of generating N tokens minus the time
of generating 1 (prefill + first token), over N - 1 steps. Bytes per decode step are what must be
read once: every weight matrix (embedding rows aside), each sequence's recurrent and conv state,
and its KV so far; GB/s is reported against the machine's measured memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time

from kvstate.commands.engine_args import add_weight_dtype


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PATH_OR_HUB_ID", default=None,
                        help="checkpoint to measure (default: a random Qwen3.5-style one, ~0.5B; quick: small)")
    parser.add_argument("--quick", action="store_true", help="a small model, short prompts (seconds)")
    parser.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per request (default 128; quick 32)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per request (default 32; quick 8)")
    parser.add_argument("--prefill-len", type=int, default=None, help="prompt of the prefill measurement (default 512)")
    parser.add_argument("--no-reference", action="store_true", help="skip transformers")
    add_weight_dtype(parser)


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: all parameters but the embedding table (tied heads count once)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or name.startswith("embed_tokens"):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    if model.lm_head.weight is model.embed_tokens.weight:
        total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return total


def _sides(args, tmp: str, llm_args: dict):
    """(kvstate LLM, transformers model or None, label) of --model or of a random checkpoint."""
    from kvstate.engine.llm import LLM

    if args.model is None:
        from kvstate.bench.checkpoints import qwen3_5_checkpoint

        size = "quick" if args.quick else "0.5b"
        path, hf = qwen3_5_checkpoint(size, tmp)
        return LLM(path, **llm_args), (None if args.no_reference else hf), f"random Qwen3.5-style {size}"
    from kvstate.config import read_plan
    from kvstate.errors import KvstateError
    from kvstate.hub import resolve_checkpoint

    path = resolve_checkpoint(args.model)
    limit = read_plan(path).max_position_embeddings
    needed = llm_args["max_model_len"] - 16
    if limit is not None and needed > limit:
        raise KvstateError(f"--prefill-len or --prompt-len + --new-tokens: {needed} tokens, more than the model's "
                           f"max_position_embeddings {limit}")
    llm = LLM(path, **{**llm_args, "max_model_len": min(needed + 16, limit or needed + 16)})
    return llm, (None if args.no_reference else _reference(path)), llm.plan.name


def _reference(path):
    """transformers' model of the checkpoint in fp32 eval mode (its fallbacks on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvstate.errors import KvstateError

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    except Exception as exc:  # noqa: BLE001 - any failure of the reference side is one line
        raise KvstateError(f"{path}: transformers cannot load it as a reference ({str(exc).splitlines()[0][:160]}); "
                           "add --no-reference to measure kvstate alone") from None


def run(args: argparse.Namespace) -> int:
    import tempfile

    import torch
    from rich.table import Table

    from kvstate.bench.timing import start
    from kvstate.engine.params import SamplingParams

    console, limits = start(args)
    plen = args.prompt_len or (32 if args.quick else 128)
    new = args.new_tokens or (8 if args.quick else 32)
    prefill_len = args.prefill_len or (128 if args.quick else 512)
    batches = [int(b) for b in args.batches.split(",")]
    llm_args = dict(max_num_seqs=max(batches), max_num_batched_tokens=max(prefill_len, max(batches) * plen),
                    max_model_len=max(prefill_len, plen + new) + 16, weight_dtype=args.weight_dtype)
    with tempfile.TemporaryDirectory(prefix="kvstate-bench-") as tmp:
        with console.status("loading checkpoint" if args.model else "building checkpoint"):
            llm, hf, label = _sides(args, tmp, llm_args)
    vocab = llm.plan.vocab_size
    g = torch.Generator().manual_seed(0)
    spec = llm.runner.spec
    wbytes = weight_bytes(llm.model)

    def ours(prompts, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - t0

    def theirs(prompts, n):
        ids = torch.tensor(prompts)
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - t0

    sides = [("kvstate", ours)] + ([] if hf is None else [("transformers", theirs)])
    rows = []
    ours([[1, 2, 3]], 2)  # warm up both sides
    if hf is not None:
        theirs([[1, 2, 3]], 2)
    for b in batches:
        prompts = torch.randint(0, vocab, (b, plen), generator=g).tolist()
        ctx = plen + new // 2  # mean context during decode
        step_bytes = wbytes + b * (spec.state_bytes + ctx * spec.kv_bytes_per_token)
        for name, fn in sides:
            with console.status(f"decode batch {b}: {name}"):
                t1 = fn(prompts, 1)
                tn = fn(prompts, new)
            step = max(tn - t1, 1e-9) / (new - 1)
            rows.append(dict(impl=name, phase="decode", batch=b, tokens_per_s=b / step, ms_per_step=1e3 * step,
                             gbps=step_bytes / step / 1e9, bandwidth_fraction=step_bytes / step / limits.bandwidth))
    prompt = [torch.randint(0, vocab, (prefill_len,), generator=g).tolist()]
    for name, fn in sides:
        with console.status(f"prefill {prefill_len}: {name}"):
            t = fn(prompt, 1)
        rows.append(dict(impl=name, phase="prefill", batch=1, tokens_per_s=prefill_len / t, ms_per_step=1e3 * t,
                         gbps=None, bandwidth_fraction=None))
    speed = {(r["impl"], r["phase"], r["batch"]): r["tokens_per_s"] for r in rows}
    ratios = {f"{phase} b={b}": speed[("kvstate", phase, b)] / speed[("transformers", phase, b)]
              for (impl, phase, b) in speed if impl == "transformers"}
    scaling = speed[("kvstate", "decode", max(batches))] / speed[("kvstate", "decode", min(batches))]
    wdtype = str(llm.model.lm_head.weight.dtype).removeprefix("torch.")
    result = dict(model=f"{label} ({llm.plan.params.total / 1e9:.2f}B, {llm.plan.layer_string})", weight_dtype=wdtype,
                  prompt_tokens=plen, new_tokens=new, weight_bytes=wbytes,
                  machine=dict(gemm_gflops=limits.gemm_flops / 1e9, bandwidth_gbps=limits.bandwidth / 1e9,
                               threads=torch.get_num_threads()),
                  rows=rows, speedup_vs_transformers=ratios, decode_scaling=scaling)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    console.print(f"{result['model']}; prompts {plen} tokens, {new} new; weights {wdtype}, "
                  f"activations fp32, {torch.get_num_threads()} threads; "
                  f"machine: bandwidth {limits.bandwidth / 1e9:.1f} GB/s, fp32 GEMM {limits.gemm_flops / 1e9:.1f} "
                  f"GFLOP/s", soft_wrap=True)
    table = Table(title="kvstate bench engine")
    for col in ("impl", "phase", "batch", "tokens/s", "ms/step", "GB/s", "% BW"):
        table.add_column(col, justify="left" if col in ("impl", "phase") else "right")
    for r in rows:
        table.add_row(r["impl"], r["phase"], str(r["batch"]), f"{r['tokens_per_s']:,.1f}", f"{r['ms_per_step']:.1f}",
                      f"{r['gbps']:.1f}" if r["gbps"] else "-",
                      f"{100 * r['bandwidth_fraction']:.0f}%" if r["bandwidth_fraction"] else "-")
    console.print(table)
    for k, v in ratios.items():
        console.print(f"kvstate / transformers, {k}: {v:.2f}x")
    console.print(f"kvstate decode throughput, batch {max(batches)} / batch {min(batches)}: {scaling:.1f}x")
    return 0
