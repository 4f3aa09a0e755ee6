"""`kvstate bench engine`: decode and prefill throughput of the engine against transformers' generate().

Same checkpoint and the same prompts on both sides, in one process: a random Qwen3.5-style one
(fp32) by default, or any checkpoint given with `--model PATH_OR_HUB_ID`. kvstate keeps its weight
matrices in `--weight-dtype` (default: the checkpoint's), activations fp32; transformers runs fp32.
Decode speed: kvstate's is the time of one generate() of N tokens minus its first engine step
(prefill + first token), over N - 1 steps; transformers' (which cannot be stepped) the time of
generating N tokens minus that of generating 1, over N - 1 (a difference of two calls would let
the prefill's variation between calls into kvstate's figure). Bytes per decode step are what must be
read once: every weight matrix (embedding rows aside), each sequence's recurrent and conv state,
and its KV so far; GB/s is reported against the machine's read bandwidth (`sum` of 1 GiB on the
same threads). `--profile 1,8` adds where a decode step's time goes at those batch sizes, with
the blocks compiled (as decode runs) and op by op (which splits their time into kernels)
(`kvstate.bench.step_profile`), and `--llama-bench BIN --gguf FILE [--gguf FILE2]` runs llama.cpp's
llama-bench on the same model (`kvstate.bench.llama_cpp` makes the GGUF files; with `--model FILE.gguf`,
`--llama-bench BIN` alone runs both on that file) and prints its prefill and decode beside ours, with ratios
(`--llama-prompt 0`: its decode only). `--rounds N` alternates N decode runs at the smallest and the largest
batch (and N batch-1 runs of kvstate and llama.cpp, and N `--depth` rounds of each) and prints the median
ratios: one-shot ratios on a noisy machine wander by 5%. With quantized weights (`--weight-dtype int8`,
`q4_k`, ...) it also measures the logits' error against the same checkpoint in fp32
(`kvstate.bench.quant_error`). `kvstate.bench.engine_table` prints the result.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import NamedTuple

from kvstate.engine.config import ACTIVATION_DTYPES
from kvstate.gguf import is_gguf
from kvstate.config.dtypes import QUANTIZED_WEIGHT_DTYPES
from kvstate.terminal.arg_types import count_arg, decode_tokens_arg, whole_number
from kvstate.terminal.engine_args import add_weight_dtype
from kvstate.terminal.number_list import number_list


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PATH_OR_HUB_ID", default=None,
                        help="checkpoint to measure (default: a random Qwen3.5-style one, ~0.5B; quick: small)")
    parser.add_argument("--quick", action="store_true", help="a small model, short prompts (seconds)")
    parser.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    parser.add_argument("--prompt-len", type=count_arg, default=None,
                        help="prompt tokens per request (default 128; quick 32)")
    parser.add_argument("--new-tokens", type=decode_tokens_arg, default=None,
                        help="tokens generated per request (default 32; quick 8)")
    parser.add_argument("--prefill-len", type=count_arg, default=None,
                        help="prompt of the prefill measurement (default 512)")
    parser.add_argument("--depth", default=None, metavar="N[,M...]",
                        help="also decode after an N-token prompt and prefill --prefill-len more tokens at depth N "
                             "(batch 1; N a multiple of --prefill-len; with --llama-bench, its -d N beside)")
    parser.add_argument("--no-reference", action="store_true", help="skip transformers")
    parser.add_argument("--profile", nargs="?", const="1", default=None, metavar="BATCHES",
                        help="time the parts of a decode step at these batch sizes (default 1)")
    parser.add_argument("--llama-bench", metavar="PATH", default=None, help="llama.cpp's llama-bench binary")
    parser.add_argument("--gguf", metavar="FILE", action="append", default=[],
                        help="the same model as GGUF for --llama-bench (repeatable: f32, bf16, ...)")
    parser.add_argument("--llama-gen", type=count_arg, default=64, help="llama-bench's decode tokens, -n (default 64)")
    parser.add_argument("--llama-prompt", type=whole_number(0), default=None, metavar="N",
                        help="llama-bench's prefill tokens, -p (default: --prefill-len; 0: decode only)")
    parser.add_argument("--rounds", type=count_arg, default=1,
                        help="also alternate N decode runs at the smallest and the largest --batches (and, "
                             "with --llama-bench, N batch-1 runs of kvstate and llama.cpp, and N rounds of "
                             "--depth on each side) and print the median ratios (a noisy machine's minutes differ)")
    add_weight_dtype(parser)
    parser.add_argument("--quant-baseline", metavar="PATH", default=None,
                        help="the unquantized model a quantized --model FILE.gguf is held against (KL divergence, "
                             "top-1 agreement; loaded in fp32); --weight-dtype is held against --model in fp32")
    parser.add_argument("--activation-dtype", choices=ACTIVATION_DTYPES, default="fp32",
                        help="bf16 weights on AVX512_BF16 CPUs: fp32 math (default, exact), bf16 (x rounded, "
                             "llama.cpp's precision) or bf16x3 (x split in three bf16 parts); GGML block "
                             "weights: q8 (x in 8-bit blocks, integer dots, llama.cpp's arithmetic); "
                             "kvstate.kernels.activation")


def _check_args(args, batches: list[int]) -> None:
    """--llama-bench and --gguf come together and name files, and --rounds has two sides to alternate:
    one clear line before any work (counts below 1 are refused when parsed)."""
    from kvstate.errors import KvstateError

    if args.llama_bench and not args.gguf and args.model and is_gguf(args.model):  # llama.cpp on the same file
        from kvstate.hub import resolve_gguf

        args.gguf = [str(resolve_gguf(args.model))]
    if bool(args.llama_bench) != bool(args.gguf):
        raise KvstateError("--llama-bench and --gguf go together (the binary and the model to run it on)")
    if args.rounds > 1 and len(set(batches)) < 2 and not args.llama_bench:
        raise KvstateError(f"--rounds {args.rounds}: alternates two --batches (or kvstate and --llama-bench); "
                           f"--batches {args.batches} names one")
    for path, what in [(args.llama_bench, "--llama-bench")] + [(g, "--gguf") for g in args.gguf]:
        if path and not Path(path).is_file():
            raise KvstateError(f"{what} {path}: no such file")


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: all parameters but the embedding table (tied heads count
    once), and int8 weights' per-row scales."""
    seen, total = set(), 0
    scales = [(n, b) for n, b in model.named_buffers() if n.endswith("weight_scale")]
    for name, p in list(model.named_parameters()) + scales:
        if id(p) in seen or name.startswith("embed_tokens"):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    if model.lm_head.weight is model.embed_tokens.weight:
        total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return total


def _sides(args, tmp: str, llm_args: dict):
    """(kvstate LLM, transformers model or None, label, checkpoint path) of --model or of a random checkpoint."""
    from kvstate.llm import LLM

    if args.model is None:
        from kvstate.bench.checkpoints import qwen3_5_checkpoint

        size = "quick" if args.quick else "0.5b"
        path, hf = qwen3_5_checkpoint(size, tmp)
        return LLM(path, **llm_args), (None if args.no_reference else hf), f"random Qwen3.5-style {size}", path
    from kvstate.families import read_plan
    from kvstate.errors import KvstateError
    from kvstate.hub import resolve_checkpoint

    path = resolve_checkpoint(args.model)
    limit = read_plan(path).max_position_embeddings
    needed = llm_args["max_model_len"] - 16
    if limit is not None and needed > limit:
        raise KvstateError(f"--prefill-len or --prompt-len + --new-tokens: {needed} tokens, more than the model's "
                           f"max_position_embeddings {limit}")
    llm = LLM(path, **{**llm_args, "max_model_len": min(needed + 16, limit or needed + 16)})
    no_reference = args.no_reference or is_gguf(args.model)  # transformers reads no qwen35 GGUF
    return llm, (None if no_reference else _reference(path)), llm.plan.name, path


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

    from kvstate.bench.timing import measure_read_bandwidth, start

    batches = number_list("--batches", args.batches, low=1)
    _check_args(args, batches)
    from kvstate.kernels.activation import set_activation_dtype

    set_activation_dtype(args.activation_dtype)  # a clear error where the CPU or the kernels lack it
    profile_batches = number_list("--profile", args.profile, low=1) if args.profile else []
    prefill_len = args.prefill_len or (128 if args.quick else 512)
    depths = sorted(set(number_list("--depth", args.depth, low=1))) if args.depth else []
    if depths:
        from kvstate.bench.depth import check_depths

        check_depths(depths, prefill_len)
    console, limits = start(args, reference=not (args.no_reference and args.model))  # the random checkpoint uses it
    with console.status("measuring the read bandwidth (sum of 1 GiB)"):
        read_bw = measure_read_bandwidth(0.125 if args.quick else 1.0)
    plen = args.prompt_len or (32 if args.quick else 128)
    new = args.new_tokens or (8 if args.quick else 32)
    most = max(batches + profile_batches)  # the engine runs the largest measured or profiled batch at once
    deepest = max(depths, default=0) + max(prefill_len, new)  # --depth's longest prompt and reply
    llm_args = dict(max_num_seqs=most, max_num_batched_tokens=max(prefill_len, most * plen),
                    max_model_len=max(prefill_len, plen + new, deepest) + 16, weight_dtype=args.weight_dtype,
                    activation_dtype=args.activation_dtype)
    with tempfile.TemporaryDirectory(prefix="kvstate-bench-") as tmp:
        with console.status("loading checkpoint" if args.model else "building checkpoint"):
            llm, hf, label, path = _sides(args, tmp, llm_args)
        result = _measure(args, console, (limits, read_bw), llm, hf, label,
                          Shape(plen, new, prefill_len, batches, profile_batches))
        from kvstate.bench.depth import engine_part

        result.update(engine_part(args, console, llm, depths, prefill_len, new))
        result.update(_quant_error(args, console, llm, path, plen, result["weight_dtype"]))
        result["activation_dtype"] = args.activation_dtype
        if args.activation_dtype != "fp32":  # what rounding the activations costs, against the exact mode
            from kvstate.bench.quant_error import activation_error

            # 32 tokens: the decode kernels' rows; 128: beyond their 64, the prefill GEMMs (GGML block
            # weights round only there: their decode kernels keep fp32 x)
            with console.status(f"{args.activation_dtype} activations' logits against fp32 math"):
                ids = torch.randint(0, llm.plan.vocab_size, (128,), generator=torch.Generator().manual_seed(1))
                result["activation_logit_error"] = activation_error(llm.model, ids[:32].tolist(), args.activation_dtype)
                result["activation_logit_error_prefill"] = activation_error(llm.model, ids.tolist(),
                                                                            args.activation_dtype)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    from kvstate.bench.engine_table import show

    show(console, result)
    return 0


def _quant_error(args, console, llm, path, plen: int, label: str) -> dict:
    """What quantized weights cost in logits against the fp32 model, on one random prompt: --weight-dtype
    against the checkpoint in fp32, a GGUF file's blocks against --quant-baseline."""
    import torch

    from kvstate.bench.quant_error import logit_error

    baseline = path if args.weight_dtype in QUANTIZED_WEIGHT_DTYPES else args.quant_baseline
    if baseline is None:
        if _block_types(llm.model):
            return dict(quant_baseline_missing=f"{label} weights: no fp32 model to hold them against (give "
                                               "--quant-baseline CHECKPOINT_OR_GGUF for KL and top-1 agreement)")
        return {}
    name = "the same checkpoint in fp32" if baseline is path else f"{Path(str(baseline)).name} in fp32"
    with console.status(f"{label} logits against the fp32 model"):
        ids = torch.randint(0, llm.plan.vocab_size, (plen,), generator=torch.Generator().manual_seed(1))
        return dict(quant_logit_error=dict(logit_error(baseline, llm.model, ids.tolist()), baseline=name))


def _block_types(model) -> list[str]:
    """The GGML block types a model's projections hold (a quantized GGUF file's), sorted."""
    return sorted({m.weight_format for m in model.modules() if getattr(m, "weight_format", None)})


class Shape(NamedTuple):
    """What `run` measures: prompt and reply lengths, the prefill length, the batch sizes."""

    plen: int
    new: int
    prefill_len: int
    batches: list[int]
    profile_batches: list[int]


class _Sides:
    """Timed generation on each side: kvstate's engine and, unless None, transformers' generate()."""

    def __init__(self, llm, hf, new: int):
        self.llm, self.hf, self.new = llm, hf, new
        self.sides = [("kvstate", self.ours)] + ([] if hf is None else [("transformers", self.theirs)])

    def ours(self, prompts, n):
        """(seconds of generating n tokens, seconds of its first engine step: prefill + first token)"""
        from kvstate.bench.timing import timed_generate

        total, steps = timed_generate(self.llm, prompts, n, clock=time.perf_counter)
        return total, steps[0]

    def our_step_s(self, prompts) -> float:
        """Seconds a decode step of ours: generate()'s time less its first step, over the other new - 1
        (always > 0: they are whole engine steps)."""
        tn, first = self.ours(prompts, self.new)
        return (tn - first) / (self.new - 1)

    def theirs(self, prompts, n):
        """(seconds of generating n tokens, None: generate() cannot be stepped)"""
        import torch

        ids = torch.tensor(prompts)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - t0, None


def _timed_rows(console, sides: _Sides, llm, shape: Shape, g, read_bw: float, wbytes: int) -> list[dict]:
    """Decode rows per batch and side (bytes per step against the read bandwidth), then prefill rows."""
    import torch

    vocab, spec, new, rows = llm.plan.vocab_size, llm.runner.cache_spec, shape.new, []
    sides.ours([[1, 2, 3]], 2)  # warm up both sides
    if sides.hf is not None:
        sides.theirs([[1, 2, 3]], 2)
    for b in shape.batches:
        prompts = torch.randint(0, vocab, (b, shape.plen), generator=g).tolist()
        ctx = shape.plen + new // 2  # mean context during decode
        step_bytes = wbytes + b * (spec.state_bytes + ctx * spec.kv_bytes_per_token)
        for name, fn in sides.sides:
            with console.status(f"decode batch {b}: {name}"):
                tn, first = fn(prompts, new)
                t1 = first if first is not None else fn(prompts, 1)[0]
            if tn <= t1:  # N tokens no slower than 1: the machine's noise swamped the decode steps
                console.print(f"[yellow]decode batch {b}, {name}: {new} tokens took no longer than 1; not "
                              f"measured (busy machine? raise --new-tokens)[/]")
                rows.append(dict(impl=name, phase="decode", batch=b, tokens_per_s=None, ms_per_step=None, gbps=None,
                                 bandwidth_fraction=None))
                continue
            step = (tn - t1) / (new - 1)
            rows.append(dict(impl=name, phase="decode", batch=b, tokens_per_s=b / step, ms_per_step=1e3 * step,
                             gbps=step_bytes / step / 1e9, bandwidth_fraction=step_bytes / step / read_bw))
    prompt = [torch.randint(0, vocab, (shape.prefill_len,), generator=g).tolist()]
    for name, fn in sides.sides:
        with console.status(f"prefill {shape.prefill_len}: {name}"):
            t = fn(prompt, 1)[0]
        rows.append(dict(impl=name, phase="prefill", batch=1, tokens_per_s=shape.prefill_len / t if t > 0 else None,
                         ms_per_step=1e3 * t, gbps=None, bandwidth_fraction=None))
    return rows


def _llama_cpp(args, console, llm, speed: dict, sides: _Sides, shape: Shape, g) -> tuple[list, dict, dict]:
    """(llama-bench's rows, kvstate against them, alternating rounds) with --llama-bench, else empty."""
    import torch

    if not args.llama_bench:
        return [], {}, {}
    from kvstate.bench.llama_cpp import compare, interleaved

    vocab, rounds = llm.plan.vocab_size, {}
    with console.status("llama.cpp: llama-bench"):
        llama_rows, vs_llama = compare(args.llama_bench, args.gguf, threads=torch.get_num_threads(),
                                       prompt=shape.prefill_len if args.llama_prompt is None else args.llama_prompt,
                                       gen=args.llama_gen,
                                       embedding_params=vocab * llm.plan.hidden_size,
                                       decode_b1=speed.get(("kvstate", "decode", 1), 0.0),
                                       prefill=speed.get(("kvstate", "prefill", 1), 0.0))
    if args.rounds > 1:
        def decode_b1() -> float:
            return 1 / sides.our_step_s(torch.randint(0, vocab, (1, shape.plen), generator=g).tolist())

        with console.status(f"{args.rounds} alternating rounds: kvstate, llama-bench"):
            rounds = interleaved(args.llama_bench, args.gguf, threads=torch.get_num_threads(),
                                 gen=args.llama_gen, decode_b1=decode_b1, rounds=args.rounds)
    return llama_rows, vs_llama, rounds


def _measure(args, console, machine: tuple, llm, hf, label, shape: Shape):
    """The timings of `run`, as the result dict (--json's form); `machine` (limits, read bandwidth)."""
    import torch

    limits, read_bw = machine
    plen, new, prefill_len, batches, profile_batches = shape
    vocab = llm.plan.vocab_size
    g = torch.Generator().manual_seed(0)
    spec = llm.runner.cache_spec
    wbytes = weight_bytes(llm.model)
    sides = _Sides(llm, hf, new)
    rows = _timed_rows(console, sides, llm, shape, g, read_bw, wbytes)
    speed = {(r["impl"], r["phase"], r["batch"]): r["tokens_per_s"] for r in rows if r["tokens_per_s"]}
    profiles = {}
    for b in profile_batches:
        from kvstate.bench.step_profile import profile_decode

        with console.status(f"profiling decode steps at batch {b}"):
            prompts = torch.randint(0, vocab, (b, plen), generator=g).tolist()
            profiles[str(b)] = profile_decode(llm, prompts, max(new - 1, 2))
            profiles[f"{b} per-op"] = profile_decode(llm, prompts, max(new - 1, 2), per_op=True)
    llama_rows, vs_llama, rounds = _llama_cpp(args, console, llm, speed, sides, shape, g)
    step_rounds = {}
    if args.rounds > 1 and len(set(batches)) > 1:
        low, high = min(batches), max(batches)
        prompts = {b: torch.randint(0, vocab, (b, plen), generator=g).tolist() for b in (low, high)}
        from kvstate.bench.timing import alternate_steps

        with console.status(f"{args.rounds} alternating rounds: decode batch {low}, batch {high}"):
            step_rounds = alternate_steps(lambda b: sides.our_step_s(prompts[b]), low, high, args.rounds)
    ratios = {f"{phase} b={b}": speed[("kvstate", phase, b)] / speed[("transformers", phase, b)]
              for (impl, phase, b) in speed if impl == "transformers" and ("kvstate", phase, b) in speed}
    ends = [speed.get(("kvstate", "decode", b)) for b in (max(batches), min(batches))]
    scaling = ends[0] / ends[1] if all(ends) else None
    blocks = _block_types(llm.model)
    wdtype = args.weight_dtype if args.weight_dtype in QUANTIZED_WEIGHT_DTYPES \
        else "+".join(blocks) if blocks else str(llm.model.lm_head.weight.dtype).removeprefix("torch.")
    from kvstate.kernels import hugepages

    result = dict(model=f"{label} ({llm.plan.params.total / 1e9:.2f}B, {llm.plan.layer_string})", weight_dtype=wdtype,
                  cache_dtypes=dict(kv=spec.kv_dtype, state=spec.state_dtype, conv=spec.conv_dtype),
                  prompt_tokens=plen, new_tokens=new, prefill_tokens=prefill_len, llama_gen=args.llama_gen,
                  weight_bytes=wbytes,
                  machine=dict(gemm_gflops=limits.gemm_flops / 1e9, bandwidth_gbps=limits.bandwidth / 1e9,
                               read_bandwidth_gbps=read_bw / 1e9, threads=torch.get_num_threads(),
                               huge_page_bytes=hugepages.huge_bytes(), huge_pages_off=hugepages.unavailable_reason()),
                  rows=rows, speedup_vs_transformers=ratios, decode_scaling=scaling, decode_step_rounds=step_rounds,
                  step_profile=profiles, llama_cpp=llama_rows, vs_llama_cpp=vs_llama,
                  vs_llama_cpp_rounds=rounds, quant_logit_error=None)
    return result
