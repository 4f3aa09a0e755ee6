"""How far quantized weights move a model's logits: the quantized model against the same model in fp32.

`kvstate bench engine --weight-dtype int8|q8_0|q4_0|q4_k` (against the checkpoint in fp32) and
`--model FILE.gguf` of a quantized file (against `--quant-baseline`, the unquantized model) print it
beside the speed, so the bytes quantization saves are never quoted without what they cost: the KL
divergence of the quantized next-token distribution from the fp32 one (nats, mean over positions),
the relative logit error and the share of positions whose top-1 token agrees.
"""

from __future__ import annotations

import gc

import torch


def logit_error(path, model, ids: list[int]) -> dict:
    """{"rel": ||logits - fp32 logits|| / ||fp32 logits|| over every position of `ids`,
    "max_rel": the worst position's, "top1": fraction of positions whose argmax agrees, "kl": mean
    KL(fp32 || ours) in nats}; the fp32 model is `path` loaded with float32 weights."""
    from kvstate.models.generate import forward_logits
    from kvstate.models.loader import load_model

    ref, _ = load_model(path, weight_dtype="float32")
    with torch.no_grad():
        ours = forward_logits(model, [ids])[0].double()
        truth = forward_logits(ref, [ids])[0].double()
    del ref
    gc.collect()  # fused projections and their groups refer to each other: free the fp32 copy now
    return _compare(ours, truth, len(ids))


def activation_error(model, ids: list[int], name: str) -> dict:
    """The same comparison for `kernels.activation.set_activation_dtype(name)` against the exact mode
    (fp32 math) on the same weights; `ids` at most MAX_ROWS_BF16 long, so every linear runs the kernel."""
    from kvstate.kernels.activation import set_activation_dtype
    from kvstate.models.generate import forward_logits

    with torch.no_grad():
        set_activation_dtype("fp32")
        truth = forward_logits(model, [ids])[0].double()
        set_activation_dtype(name)
        ours = forward_logits(model, [ids])[0].double()
    return _compare(ours, truth, len(ids))


def _compare(ours: torch.Tensor, truth: torch.Tensor, positions: int) -> dict:
    per_pos = (ours - truth).norm(dim=-1) / truth.norm(dim=-1).clamp_min(1e-30)
    log_p, log_q = truth.log_softmax(-1), ours.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [positions]
    return dict(rel=float((ours - truth).norm() / truth.norm()), max_rel=float(per_pos.max()),
                top1=float((ours.argmax(-1) == truth.argmax(-1)).double().mean()), kl=float(kl.mean()),
                max_kl=float(kl.max()), positions=positions)


def first_token_agreement(model, ref, vocab: int, *, prompts: int = 100, length: int = 16, seed: int = 0,
                          group: int | None = None) -> dict:
    """How often the first greedy token of `model` equals `ref`'s on `prompts` random prompts of `length`
    tokens (uniform over `vocab`, seeded) -> {"agree": fraction, "prompts", "length", "margin": the median
    gap between `ref`'s two most likely logits (small gaps are what a quantization can flip)}."""
    from kvstate.models.generate import forward_logits

    from kvstate.kernels.blocks import MAX_ROWS

    group = group or max(1, MAX_ROWS // length)  # rows the compiled block kernels take in one call
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, vocab, (prompts, length), generator=g).tolist()
    same, margins = 0, []
    with torch.no_grad():
        for start in range(0, prompts, group):
            part = seqs[start:start + group]
            ours = torch.stack([lg[-1] for lg in forward_logits(model, part)])  # [group, vocab]
            truth = torch.stack([lg[-1] for lg in forward_logits(ref, part)])
            same += int((ours.argmax(-1) == truth.argmax(-1)).sum())
            top2 = truth.topk(2, dim=-1).values
            margins += (top2[:, 0] - top2[:, 1]).tolist()
    return dict(agree=same / prompts, prompts=prompts, length=length, margin=float(torch.tensor(margins).median()))


def main(argv: list[str] | None = None) -> int:
    """`python -m kvstate.bench.quant_error --model Q --baseline B`: the first-token agreement of a quantized
    model (a quantized GGUF file, or --model with --weight-dtype) with its baseline in fp32."""
    import argparse
    import json

    from kvstate.models.loader import load_model

    parser = argparse.ArgumentParser(prog="python -m kvstate.bench.quant_error", description=main.__doc__)
    parser.add_argument("--model", required=True, help="the quantized model (a GGUF file, or a checkpoint "
                                                       "quantized by --weight-dtype)")
    parser.add_argument("--baseline", default=None, help="the unquantized model, loaded in fp32 (default: --model)")
    parser.add_argument("--weight-dtype", default=None, help="quantize --model at load (q8_0, q4_0, q4_k, int8)")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--length", type=int, default=16)
    args = parser.parse_args(argv)
    model, plan = load_model(args.model, weight_dtype=args.weight_dtype)
    ref, _ = load_model(args.baseline or args.model, weight_dtype="float32")
    out = first_token_agreement(model, ref, plan.vocab_size, prompts=args.prompts, length=args.length)
    print(json.dumps(dict(out, model=str(args.model), baseline=str(args.baseline or args.model),
                          weight_dtype=args.weight_dtype)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
