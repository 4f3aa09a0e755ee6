"""`kvstate eval perplexity`: what a precision costs in quality, as llama.cpp users know it from
`llama-perplexity` (with --kl-divergence).

    kvstate eval perplexity --model M --file text.txt --context 512 --weight-dtype fp32,bf16,int8 --kl-base fp32

prints one row per weight dtype: perplexity over sliding windows, and against the base (fp32
weights loaded beside them, or a file saved by --save-base) the KL divergence per token (mean,
median, 99th percentile, max) and how often the most likely token is the base's. Without --model
and --file it scores the shipped kvstate-phonebook-hybrid on the text shipped for it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from kvstate.errors import KvstateError
from kvstate.terminal.arg_types import count_arg
from kvstate.terminal.engine_args import weight_dtype_arg

SHIPPED_TEXT = Path(__file__).resolve().parents[1] / "data" / "eval" / "phonebook_chats.txt"


def _dtypes(text: str) -> list[str]:
    names = [weight_dtype_arg(t.strip()) for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give one or more of fp32, bf16, int8 (comma-separated)")
    return names


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval_command", metavar="<measure>")
    p = sub.add_parser("perplexity", help="perplexity over sliding windows; KL and top-1 agreement against a base",
                       description="perplexity over sliding windows of a text; with --kl-base, the KL divergence "
                                   "and top-1 agreement against a base, token by token")
    p.add_argument("--model", default=None, metavar="PATH_OR_HUB_ID",
                   help="checkpoint directory, hub id or shipped model's name (default: kvstate-phonebook-hybrid)")
    p.add_argument("--file", default=None, metavar="TEXT_FILE",
                   help=f"UTF-8 text to score (default: the shipped {SHIPPED_TEXT.name})")
    p.add_argument("--context", type=count_arg, default=512, metavar="N", help="tokens per window (default: 512)")
    p.add_argument("--stride", type=count_arg, default=None, metavar="N",
                   help="tokens between window starts; each token is scored once (default: context / 2)")
    p.add_argument("--weight-dtype", type=_dtypes, default=None, metavar="DTYPES",
                   help="weights in fp32, bf16 or int8; a comma-separated list gives one row each "
                        "(default: the checkpoint's)")
    p.add_argument("--kl-base", default=None, metavar="DTYPE_OR_FILE",
                   help="compare against this base: a weight dtype (e.g. fp32) loaded beside, or a file of --save-base")
    p.add_argument("--save-base", default=None, metavar="FILE",
                   help="save the first weight dtype's top tokens per position as a base file for later --kl-base")
    p.add_argument("--max-tokens", type=count_arg, default=None, metavar="N",
                   help="score only the first N tokens of the text")
    p.add_argument("--json", action="store_true", help="one JSON object with every row instead of the table")


def run(args: argparse.Namespace) -> int:
    if args.eval_command != "perplexity":
        raise KvstateError("give a measure: kvstate eval perplexity --help")
    from kvstate.hub import resolve_checkpoint
    from kvstate.shipped import DEFAULT_MODEL

    path = Path(args.file) if args.file else SHIPPED_TEXT
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KvstateError(f"--file {path}: cannot read it as UTF-8 text ({exc.__class__.__name__})") from None
    model_path = resolve_checkpoint(args.model or DEFAULT_MODEL)
    from kvstate.models.loader import load_model
    from kvstate.models.tokenizer import Tokenizer

    ids = Tokenizer(model_path).encode(text)
    if args.max_tokens is not None:
        ids = ids[:args.max_tokens]
    return _evaluate(args, model_path, ids, load_model)


def _evaluate(args, model_path: Path, ids: list[int], load_model) -> int:
    from kvstate.eval.perplexity import BaseFile, score
    from kvstate.eval.windows import sliding_windows
    from kvstate.terminal.console import make_console

    windows = sliding_windows(len(ids), args.context, args.stride)
    stride = args.stride or args.context // 2
    meta = {"tokens_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(), "context": args.context,
            "stride": stride, "model": str(model_path)}
    dtypes = args.weight_dtype or [None]
    if args.save_base and not Path(args.save_base).resolve().parent.is_dir():
        raise KvstateError(f"--save-base {args.save_base}: its folder does not exist")
    base_model = base_file = None
    base_name = args.kl_base
    if base_name is not None:
        try:
            base_dtype = weight_dtype_arg(base_name)
        except argparse.ArgumentTypeError:
            base_dtype = None
        if base_dtype is not None:
            base_model = load_model(model_path, weight_dtype=base_dtype)[0]
            base_name = base_dtype
        elif Path(base_name).is_file():
            base_file = BaseFile.load(Path(base_name))
            base_file.check(meta)
        else:
            raise KvstateError(f"--kl-base {base_name}: neither a weight dtype (fp32, bf16, int8) nor a base file")
    console = make_console(stderr=True)
    rows, base_scores = [], base_file.scores() if base_file is not None else None
    bar = _bar(console, len(windows) * len(dtypes), enabled=not args.json)
    with bar as tick:
        for i, dtype in enumerate(dtypes):
            model = load_model(model_path, weight_dtype=dtype)[0]
            keep = BaseFile(meta) if args.save_base and i == 0 else None
            mine, theirs = score(model, ids, windows, base_model=base_model, base_file=base_file, keep=keep,
                                 progress=tick)
            if theirs is not None:
                base_scores = theirs
            if keep is not None:
                keep.save(Path(args.save_base))
            blocks = sorted({m.weight_format for m in model.modules() if getattr(m, "weight_format", None)})
            name = dtype or "+".join(blocks) or str(model.lm_head.weight.dtype).removeprefix("torch.")
            rows.append({"weight_dtype": name, **mine.summary(base_scores)})
    report = {"model": str(model_path), "tokens": len(ids), "context": args.context, "stride": stride,
              "windows": len(windows), "kl_base": base_name, "rows": rows}
    if args.json:
        print(json.dumps(report))
    else:
        _table(report)
    return 0


class _NoBar:
    def __enter__(self):
        return lambda: None

    def __exit__(self, *exc):
        return False


def _bar(console, total: int, *, enabled: bool):
    if not enabled or not console.is_terminal:
        return _NoBar()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    class _Bar:
        def __enter__(self):
            self.p = Progress(TextColumn("scoring windows"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                              console=console, transient=True)
            self.p.__enter__()
            task = self.p.add_task("windows", total=total)
            return lambda: self.p.advance(task)

        def __exit__(self, *exc):
            return self.p.__exit__(*exc)

    return _Bar()


def _table(report: dict) -> None:
    from rich.table import Table

    from kvstate.terminal.console import make_console

    console = make_console()
    t = Table(title=f"perplexity of {Path(report['model']).name}: {report['tokens']} tokens, windows of "
                    f"{report['context']} every {report['stride']}"
                    + (f"; KL against {report['kl_base']}" if report["kl_base"] else ""))
    kl = any("kl_mean" in r for r in report["rows"])
    t.add_column("weights")
    t.add_column("PPL", justify="right")
    if kl:
        for name in ("ln(PPL/base)", "mean KL", "median KL", "99% KL", "max KL", "same top-1"):
            t.add_column(name, justify="right")
    for r in report["rows"]:
        cells = [r["weight_dtype"], f"{r['ppl']:.4f}"]
        if kl:
            cells += [f"{r['ln_ppl_ratio']:+.5f}", f"{r['kl_mean']:.6f}", f"{r['kl_median']:.6f}",
                      f"{r['kl_p99']:.6f}", f"{r['kl_max']:.6f}", f"{100 * r['top1_agree']:.2f}%"]
        t.add_row(*cells)
    console.print(t)
