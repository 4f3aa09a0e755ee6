"""llama.cpp on the same model: make the GGUF files and run `llama-bench` beside `kvstate bench engine`.

The recipe of `shared/reference/llama-cpp-anchor.md` as code, so the comparison can be remade:
- `make_checkpoint(dir)`: the bench's random Qwen3.5-style checkpoint plus a byte-level BPE
  tokenizer (the converter needs one; trained here on kvstate's own sources, no download);
- `convert(source, checkpoint, outtype, outfile)`: llama.cpp's `convert_hf_to_gguf.py` from the
  llama.cpp source tree `source`, in a child process, with `get_vocab_base_pre` answering "qwen2"
  (the converter does not know a tokenizer trained here);
- `run_llama_bench(binary, gguf)`: `llama-bench -o json`, parsed to prefill / decode tokens/s.

Make the files (once, minutes): `python -m kvstate.bench.llama_cpp --source LLAMA_CPP_DIR --out DIR
--outtype f32,bf16 [--size 0.8b] [--quantize q8_0,q4_k_m] [--llama-quantize BIN]` (`quantize`:
llama-quantize on the bf16 file, by default Q8_0 and Q4_K_M with the binary of LLAMA_CPP_DIR/build/bin
where it is built); then `kvstate bench engine --llama-bench BIN --gguf DIR/f32.gguf --gguf ...`, or
`kvstate bench engine --model DIR/qwen35-0.5b-q8_0.gguf --llama-bench BIN` (both on that one file).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvstate.errors import KvstateError

# The converter, run in a child: llama.cpp's own modules first on sys.path, the tokenizer check
# patched, then the script as __main__ with the given argv.
_CONVERT = """
import runpy, sys
src, argv = sys.argv[1], sys.argv[2:]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = [src + "/convert_hf_to_gguf.py", *argv]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


@dataclass(frozen=True)
class LlamaBenchRow:
    """One llama-bench test: "pp512" (prefill of 512 tokens) or "tg64" (64 decode steps at batch 1), with
    " @ d8192" after a depth (the test ran after an 8192-token context: `-d`)."""

    test: str
    tokens_per_s: float
    stddev: float
    model_type: str  # llama-bench's description, e.g. "qwen35 ?B F32"
    model_size: int  # bytes of the GGUF's tensors
    model_params: int
    threads: int
    depth: int = 0


def parse_results(text: str) -> list[LlamaBenchRow]:
    """llama-bench's `-o json` output (a JSON list of tests) -> rows; a test is pp when it has prompt
    tokens and no generated ones, tg the other way round."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KvstateError(f"llama-bench printed no JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(tests, list) or not tests:
        raise KvstateError("llama-bench printed no test results")
    rows = []
    for t in tests:
        try:
            n_prompt, n_gen = int(t["n_prompt"]), int(t["n_gen"])
            name = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}" if n_prompt == 0 else f"pp{n_prompt}+tg{n_gen}"
            depth = int(t.get("n_depth", 0))
            rows.append(LlamaBenchRow(name + (f" @ d{depth}" if depth else ""), float(t["avg_ts"]),
                                      float(t.get("stddev_ts", 0.0)), str(t.get("model_type", "")),
                                      int(t.get("model_size", 0)), int(t.get("model_n_params", 0)),
                                      int(t.get("n_threads", 0)), depth))
        except (KeyError, TypeError, ValueError) as exc:
            raise KvstateError(f"llama-bench result without a usable {exc} field") from None
    return rows


def run_llama_bench(binary: str, gguf: str, *, threads: int = 2, prompt: int = 512, gen: int = 64,
                    depths: list[int] | None = None, repetitions: int | None = None,
                    timeout: float = 1800) -> list[LlamaBenchRow]:
    """Run `binary -m gguf -t threads -p prompt -n gen [-d depths] [-r repetitions] -o json`; its rows,
    or one clear error."""
    for path, what in ((binary, "--llama-bench"), (gguf, "--gguf")):
        if not Path(path).is_file():
            raise KvstateError(f"{what} {path}: no such file")
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n", str(gen), "-o", "json"]
    if depths:
        cmd += ["-d", ",".join(map(str, depths))]
    if repetitions:
        cmd += ["-r", str(repetitions)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KvstateError(f"llama-bench did not run: {exc}") from None
    if done.returncode < 0:  # killed by a signal: it prints nothing
        name = _signal_name(-done.returncode)
        hint = (" (an instruction this CPU or VM does not run: rebuild llama.cpp here, or try --llama-prompt 0 "
                "if only its prefill path uses it)") if name == "SIGILL" else ""
        raise KvstateError(f"llama-bench was killed by {name}{hint}: {' '.join(cmd[1:])}")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise KvstateError(f"llama-bench exited with {done.returncode}: {last[:200]}")
    return parse_results(done.stdout)


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def compare(binary: str, ggufs: list[str], *, threads: int, prompt: int, gen: int, embedding_params: int,
            decode_b1: float, prefill: float) -> tuple[list[dict], dict[str, float]]:
    """llama-bench on each GGUF -> (its rows as dicts, {label: kvstate tokens/s / llama.cpp's}) for
    kvstate's batch-1 decode (`decode_b1`) against tg and its prefill (`prefill`) against pp. A row's
    `streamed_bytes` is what a decode step reads: the GGUF's tensors but the embedding table (one row
    of it is read), at the file's mean bytes per parameter."""
    rows, ratios = [], {}
    for gguf in ggufs:
        name = Path(gguf).name
        for r in run_llama_bench(binary, gguf, threads=threads, prompt=prompt, gen=gen):
            share = 1 - embedding_params / r.model_params if r.model_params > embedding_params else 1.0
            rows.append(dict(gguf=name, test=r.test, tokens_per_s=r.tokens_per_s, stddev=r.stddev,
                             model_type=r.model_type, model_size=r.model_size, model_params=r.model_params,
                             streamed_bytes=int(r.model_size * share), threads=r.threads))
            ours = decode_b1 if r.test.startswith("tg") else prefill if r.test.startswith("pp") else None
            if ours and r.tokens_per_s > 0:
                ratios[f"{'decode b=1' if r.test.startswith('tg') else 'prefill'} vs {name} {r.test}"] = (
                    ours / r.tokens_per_s)
    return rows, ratios


def interleaved(binary: str, ggufs: list[str], *, threads: int, gen: int, decode_b1, rounds: int) -> dict:
    """`rounds` alternating decode measurements: kvstate's batch-1 decode (`decode_b1()` -> tokens/s),
    then llama-bench's tg on each GGUF, again and again, so that both sides see the same minutes of a
    noisy machine -> {label: {"median": median ratio, "ratios": per round, "ours", "theirs": tokens/s}}."""
    out: dict[str, dict] = {}
    for _ in range(rounds):
        ours = decode_b1()
        for gguf in ggufs:
            for r in run_llama_bench(binary, gguf, threads=threads, prompt=0, gen=gen):
                if r.test.startswith("tg") and r.tokens_per_s > 0 and ours > 0:
                    entry = out.setdefault(f"decode b=1 vs {Path(gguf).name} {r.test}",
                                           dict(ratios=[], ours=[], theirs=[]))
                    entry["ratios"].append(ours / r.tokens_per_s)
                    entry["ours"].append(ours)
                    entry["theirs"].append(r.tokens_per_s)
    for entry in out.values():
        entry["median"] = statistics.median(entry["ratios"])
    return out


def make_checkpoint(directory: str | Path, size: str = "0.5b") -> Path:
    """The bench's random Qwen3.5-style checkpoint in `directory` with a byte-level BPE tokenizer.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvstate.bench.checkpoints import SIZES, qwen3_5_checkpoint
    from kvstate.gguf.tokenizer import PRE_TOKENIZERS

    path, _ = qwen3_5_checkpoint(size, str(directory))
    tok = Tokenizer(models.BPE())
    # Qwen2's split regex: the pre-tokenizer `convert` names ("qwen2"), so the GGUF files tokenize as this does
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZERS["qwen2"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SIZES[size]["vocab_size"], special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [p.read_text(encoding="utf-8") for p in sorted(Path(__file__).parents[1].rglob("*.py"))]
    tok.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return Path(path)


def convert(source: str | Path, checkpoint: str | Path, outtype: str, outfile: str | Path, *,
            no_mtp: bool = True) -> Path:
    """llama.cpp's converter (of the source tree `source`) on `checkpoint` -> `outfile` in `outtype`
    (`no_mtp`: without the MTP head, which the bench leaves out; False for families the flag refuses)."""
    script = Path(source) / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise KvstateError(f"{source}: not a llama.cpp source tree (no convert_hf_to_gguf.py)")
    argv = [str(checkpoint), *(["--no-mtp"] if no_mtp else []), "--outtype", outtype, "--outfile", str(outfile)]
    done = subprocess.run([sys.executable, "-c", _CONVERT, str(Path(source).resolve()), *argv],
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise KvstateError(f"convert_hf_to_gguf.py --outtype {outtype} failed: {last[:200]}")
    return Path(outfile)


# llama-quantize's names of the file types it writes, by --quantize's spelling
QUANT_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K",
               "iq4_xs": "IQ4_XS"}


def quantize(binary: str | Path, source: str | Path, qtype: str, outfile: str | Path, *, threads: int = 2) -> Path:
    """llama.cpp's `llama-quantize` on the GGUF `source` -> `outfile` in `qtype` (a QUANT_TYPES key)."""
    if qtype not in QUANT_TYPES:
        raise KvstateError(f"quantize type {qtype!r}: expected one of {', '.join(QUANT_TYPES)}")
    try:
        done = subprocess.run([str(binary), str(source), str(outfile), QUANT_TYPES[qtype], str(threads)],
                              capture_output=True, text=True)
    except OSError as exc:
        raise KvstateError(f"{binary}: cannot run llama-quantize ({exc.strerror or exc})") from None
    if done.returncode != 0:
        last = ((done.stderr + done.stdout).strip().splitlines() or ["(no message)"])[-1]
        raise KvstateError(f"llama-quantize {QUANT_TYPES[qtype]} failed: {last[:200]}")
    return Path(outfile)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstate.bench.llama_cpp", description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, help="llama.cpp source tree (has convert_hf_to_gguf.py)")
    parser.add_argument("--out", required=True, help="folder for the checkpoint and the GGUF files")
    parser.add_argument("--outtype", default="f32,bf16", help="comma-separated: f32, bf16, q8_0, ...")
    parser.add_argument("--size", default="0.5b", help="bench checkpoint size (0.5b, 0.8b: Qwen3.5-0.8B's config, "
                                                       "or quick)")
    parser.add_argument("--quantize", default=None, metavar="LIST",
                        help=f"also write these from the bf16 file with llama-quantize ({', '.join(QUANT_TYPES)}; "
                             "default q8_0,q4_k_m where the binary is found, '' for none)")
    parser.add_argument("--llama-quantize", default=None, metavar="PATH",
                        help="llama.cpp's llama-quantize binary (default: SOURCE/build/bin/llama-quantize)")
    args = parser.parse_args(argv)
    found = Path(args.source) / "build" / "bin" / "llama-quantize"
    if args.llama_quantize is None and found.is_file():
        args.llama_quantize = str(found)
    if args.quantize is None:
        args.quantize = "q8_0,q4_k_m" if args.llama_quantize else ""
        if not args.llama_quantize:
            print(f"no llama-quantize at {found}: writing no quantized files (--llama-quantize PATH)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        ckpt = out / f"checkpoint-{args.size}"
        if not (ckpt / "tokenizer.json").is_file():
            print(f"making {ckpt}", flush=True)
            make_checkpoint(ckpt, args.size)
        for outtype in args.outtype.split(","):
            target = out / f"qwen35-{args.size}-{outtype}.gguf"
            print(f"converting to {target}", flush=True)
            convert(args.source, ckpt, outtype, target)
        if args.quantize:
            if not args.llama_quantize:
                raise KvstateError("--quantize needs --llama-quantize PATH (llama.cpp's llama-quantize binary)")
            bf16 = out / f"qwen35-{args.size}-bf16.gguf"
            if not bf16.is_file():
                convert(args.source, ckpt, "bf16", bf16)
            for qtype in args.quantize.split(","):
                if not qtype:
                    continue
                target = out / f"qwen35-{args.size}-{qtype}.gguf"
                print(f"quantizing to {target}", flush=True)
                quantize(args.llama_quantize, bf16, qtype, target)
    except KvstateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
