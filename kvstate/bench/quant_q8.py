"""`python -m kvstate.bench.quant_q8`: GGML block GEMVs, the exact kernels against the "q8" mode's
integer kernels (`activation_dtype="q8"`), per block type, in one process on the same inputs.

Each shape is held in enough copies (`--mib` of blocks in all) that every call streams its weights
from memory, not from cache; one timed call multiplies x [M, K] with every copy. Printed per type,
shape and M: GB/s of blocks streamed by each mode, their share of the measured read bandwidth (a
`sum` over 4x `--mib`) and q8 / exact, from alternating rounds (noisy machines: read the ratios).
"""

from __future__ import annotations

import argparse
import json

from kvstate.errors import KvstateError
from kvstate.terminal.arg_types import count_arg
from kvstate.terminal.number_list import number_list

SHAPES = ((6144, 1024), (1024, 3584))  # N x K: the 0.5B bench model's GDN in_proj, MLP down_proj
# where each block type keeps its fp16 scales (byte offsets in the block)
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
               "IQ4_XS": (0,)}


def random_blocks(qtype: str, rows: int, blocks: int, seed: int):
    """uint8 numpy [rows, blocks * bytes]: random bytes, each fp16 scale a small finite random value."""
    import numpy as np

    from kvstate.kernels.ggml_blocks import TYPES

    t = TYPES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * blocks, t.nbytes), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        raw[:, at:at + 2] = (rng.standard_normal(rows * blocks) * 0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks * t.nbytes)


def measure(types: list[str], rows: list[int], mib: int, rounds: int, min_time: float) -> list[dict]:
    return [r for qtype in types for n, k in SHAPES for r in _shape(qtype, n, k, rows, mib, rounds, min_time)]


def _shape(qtype: str, n: int, k: int, rows: list[int], mib: int, rounds: int, min_time: float) -> list[dict]:
    """One type and shape at each M: the copies of the matrix live only while it is measured."""
    import torch

    from kvstate.bench.linear import interleaved
    from kvstate.kernels import extension
    from kvstate.kernels.ggml_blocks import TYPES

    ext = extension()
    one = torch.from_numpy(random_blocks(qtype, n, k // TYPES[qtype].block, seed=n + k))
    copies = [one] + [one.clone() for _ in range(max(0, mib * 2**20 // one.nbytes - 1))]
    nbytes = one.nbytes * len(copies)
    out = []
    for m in rows:
        x = torch.randn(m, k)

        def run(q8: bool):
            ext.set_q8_activations(q8)
            for w in copies:
                ext.quant_linear(x, w, None, TYPES[qtype].type_id)

        try:
            exact, q8 = interleaved([lambda: run(False), lambda: run(True)], min_time, rounds)
        finally:
            ext.set_q8_activations(False)
        out.append(dict(type=qtype, n=n, k=k, rows=m, exact_gbs=nbytes / exact / 1e9, q8_gbs=nbytes / q8 / 1e9,
                        ratio=exact / q8))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstate.bench.quant_q8", description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0,Q5_K", help="GGML block types")
    parser.add_argument("--rows", default="1,8", help="rows of x (decode batch sizes)")
    parser.add_argument("--mib", type=count_arg, default=256, help="MiB of blocks per shape (copies of the matrix)")
    parser.add_argument("--rounds", type=count_arg, default=3, help="alternating rounds (the best of each side)")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds per side in all")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from kvstate.bench.linear import read_bandwidth
    from kvstate.kernels import extension, info
    from kvstate.kernels.activation import q8_available
    from kvstate.kernels.ggml_q8 import X_TYPE

    if not q8_available():
        print(f"the compiled kernels are missing: {info()['reason']}")
        return 2
    ext = extension()
    types = [t.strip().upper() for t in args.types.split(",")]
    bad = [t for t in types if t not in X_TYPE]
    if bad:
        print(f"--types: {', '.join(bad)} not served by the q8 mode (expected some of {', '.join(sorted(X_TYPE))})")
        return 2
    from kvstate.kernels.blocks import MAX_ROWS

    try:  # the q8 mode serves up to MAX_ROWS rows; past them both columns would be the exact kernel
        rows = number_list("--rows", args.rows, low=1, high=MAX_ROWS)
    except KvstateError as e:
        print(e)
        return 2
    bw = read_bandwidth(4 * args.mib)
    results = measure(types, rows, args.mib, args.rounds, args.min_time)
    if args.json:
        print(json.dumps(dict(read_gbs=bw / 1e9, results=results), indent=2))
        return 0
    import torch

    isa = "AVX-512 VNNI" if ext.quant_q8_has_vnni() else "AVX2"
    print(f"read bandwidth {bw / 1e9:.1f} GB/s; {torch.get_num_threads()} threads; q8 kernels: {isa}")
    print(f"{'type':<6}{'N x K':>12}{'M':>4}{'exact GB/s':>12}{'q8 GB/s':>10}{'exact bw':>10}{'q8 bw':>8}"
          f"{'q8/exact':>10}")
    for r in results:
        print(f"{r['type']:<6}{r['n']:>6} x {r['k']:<5}{r['rows']:>3}{r['exact_gbs']:>12.1f}{r['q8_gbs']:>10.1f}"
              f"{100 * r['exact_gbs'] * 1e9 / bw:>9.0f}%{100 * r['q8_gbs'] * 1e9 / bw:>7.0f}%{r['ratio']:>9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
