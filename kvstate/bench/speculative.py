"""`kvstate bench speculative`: speculative decoding's acceptance rate and batch-1 decode tokens/s, with and without.

One target model (a random ~0.5B Qwen3.5-style checkpoint; `--quick`: a small one; `--model`: any
checkpoint or shipped model's name), one engine; only the proposer changes between runs, so every
row runs the same weights, pools and prompts:
- oracle: replays the target's own greedy continuation (acceptance 100%, no drafting cost), so
  the row shows what verifying k+1 tokens in one forward costs and gains;
- ngram: prompt lookup on a copy-heavy prompt (a passage repeated); on a random model greedy
  decoding copies only where it happens to, so the acceptance is measured, not assumed. With
  `--model` of a checkpoint that has a chat template the copy-heavy prompt is a chat asking it to
  repeat a passage of random words ("Repeat this:\n..."), the task the shipped models learnt;
- draft: a smaller random Qwen3.5-style checkpoint of the same vocabulary (unrelated to the
  target, so it rarely agrees: the row shows the cost of drafting more than its gain);
- mtp: the checkpoint's own multi-token-prediction head (docs/mtp.md), k = 1, 2, 3 whatever
  `--ks` says. The random target gets a random head (acceptance ~0: the row is what a wrong draft
  costs); a `--model` without one gets no mtp row. On the copy-heavy prompt where the model has
  a chat template (the shipped models' trained heads), on the random prompt otherwise.
Decode speed is the fastest time of N new tokens minus the fastest time of 1 (prefill and first
token) over `--repeats` runs, over N - 1 tokens; each row's plain speed is measured in turn with it (drafted,
plain, drafted, plain, ...), on the same prompt: a shared machine's load drifts over seconds.
Every speculative run is checked token for token against plain greedy decoding ("exact").
"""

from __future__ import annotations

import argparse
import json
import time

from kvstate.engine.speculative.drafter import Drafter
from kvstate.terminal.arg_types import count_arg, decode_tokens_arg

DRAFT_DIMS = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=4,
                  linear_key_head_dim=64, linear_value_head_dim=64)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a small target, short runs (seconds)")
    parser.add_argument("--ks", default=None, help="drafted tokens per step to try (default 2,4,8; quick 2,4)")
    parser.add_argument("--prompt-len", type=count_arg, default=None, help="prompt tokens (default 128; quick 32)")
    parser.add_argument("--new-tokens", type=decode_tokens_arg, default=None,
                        help="tokens generated (default 64; quick 16)")
    parser.add_argument("--repeats", type=count_arg, default=2,
                        help="runs per row, drafted and plain in turn; the fastest of each counts (default 2)")
    parser.add_argument("--methods", default="oracle,ngram,draft,mtp", help="which drafters (default: all four)")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="target checkpoint or shipped model name (default: a random Qwen3.5-style one)")


class OracleDrafter(Drafter):
    """Drafts the continuation the target is known to produce (the benchmark's upper bound)."""

    def __init__(self, expected: dict[tuple, list[int]]):
        self.expected = expected  # prompt -> prompt + the plain greedy output

    def propose(self, requests):
        return [self.expected[tuple(s.prompt_token_ids)][s.num_tokens : s.num_tokens + k] for s, k in requests]


def copy_prompt(llm, plen: int, new: int, g) -> list[int]:
    """Token ids of a prompt whose continuation repeats text it holds: with a chat template, a chat
    asking the model to repeat a passage of about `new` words; otherwise a random passage of
    plen / 2 tokens three times (the model continues a passage it has seen twice)."""
    import numpy as np
    import torch

    tok = llm.tokenizer
    if tok is not None and tok.chat_template:
        from kvstate.recall.chat_data import passage

        text = passage(np.random.default_rng(0), new)
        chat = tok.apply_chat_template([{"role": "user", "content": f"Repeat this:\n{text}"}])
        return tok.encode(chat, add_special_tokens=False)
    return torch.randint(0, llm.plan.vocab_size, (plen // 2,), generator=g).tolist() * 3


def draft_checkpoint(vocab: int, directory: str):
    """A small random Qwen3.5-style checkpoint with the target's vocabulary."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    n = DRAFT_DIMS["num_hidden_layers"]
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    torch.manual_seed(1)
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(layer_types=types, max_position_embeddings=32768, vocab_size=vocab,
                                         **DRAFT_DIMS)).float().save_pretrained(directory)
    return directory


def _ks(args) -> list[int]:
    """--ks as drafted-token counts (a KvstateError for anything else)."""
    from kvstate.errors import KvstateError

    text = args.ks or ("2,4" if args.quick else "2,4,8")
    try:
        ks = [int(k) for k in text.split(",")]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise KvstateError(f"--ks: expected comma-separated positive drafted-token counts, got {text!r}")
    return ks


def _engine(args, methods: list[str], plen: int, new: int, console):
    """(LLM of the target, the methods it can run, the draft (model, plan) or None): the target built
    (a random Qwen3.5-style one, with a random MTP head for the mtp rows) or loaded from --model."""
    import tempfile

    from kvstate.bench.checkpoints import add_random_mtp, qwen3_5_checkpoint
    from kvstate.errors import KvstateError
    from kvstate.llm import LLM
    from kvstate.models.loader import load_model

    shape = dict(max_num_seqs=1, max_num_batched_tokens=4 * plen, max_model_len=4 * plen + new + 32, cache_memory=None)
    with tempfile.TemporaryDirectory(prefix="kvstate-bench-spec-") as tmp:
        with console.status("building checkpoints"):
            if args.model is None:
                path, hf = qwen3_5_checkpoint("quick" if args.quick else "0.5b", f"{tmp}/target")
                del hf
                if "mtp" in methods:
                    add_random_mtp(path)
            else:
                path = args.model
            # with an MTP head the pools hold its KV (plain rows run without keeping hidden states)
            mtp_spec = {"method": "mtp", "num_speculative_tokens": 3} if "mtp" in methods else None
            try:
                llm = LLM(path, **shape, speculative_config=mtp_spec)
            except KvstateError:
                if mtp_spec is None:
                    raise
                methods = [m for m in methods if m != "mtp"]  # a checkpoint without a head: no mtp row
                llm = LLM(path, **shape)
            vocab = llm.plan.vocab_size
            draft = load_model(draft_checkpoint(vocab, f"{tmp}/draft")) if "draft" in methods else None
    return llm, methods, draft


def _once(llm, prompt, make, new: int):
    """(seconds of 1 new token, seconds of `new`, output, proposer) of batch-1 greedy decoding with
    the (speculative config, drafter) of `make()` (`make` None: plain)."""
    from kvstate.engine.params import SamplingParams

    times = []
    for n in (1, new):
        prop = llm.engine.set_proposer(*make()) if make is not None else llm.engine.set_proposer(None)
        t0 = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        times.append(time.perf_counter() - t0)
    return times[0], times[1], out.token_ids, prop


def _race(llm, prompt, makes: dict, new: int, repeats: int) -> dict:
    """{name: (tokens/s, output, proposer)} over `repeats` rounds in which each proposer decodes
    once, in turn: each one's fastest times come from the same stretch of time as the others', so
    a shared machine's load drifting over seconds does not enter their ratio. Tokens/s is
    (new - 1) / (fastest time of `new` tokens - fastest time of 1): a slow 1-token run alone does
    not inflate it."""
    fastest: dict = {}
    for _ in range(repeats):
        for name, make in makes.items():
            one, full, out, prop = _once(llm, prompt, make, new)
            if name in fastest:
                one, full = min(one, fastest[name][0]), min(full, fastest[name][1])
            fastest[name] = (one, full, out, prop)
    return {name: ((new - 1) / max(full - one, 1e-9), out, prop)
            for name, (one, full, out, prop) in fastest.items()}


def _drafters(llm, prompts: dict, plain: dict, draft) -> dict:
    """{method: (the prompt it runs on, k -> a new drafter)}."""
    from kvstate.engine.speculative.draft_model import DraftModelDrafter
    from kvstate.engine.speculative.mtp import MtpDrafter
    from kvstate.engine.speculative.ngram import NgramDrafter

    core = llm.engine
    expected = {tuple(p): p + plain[name][1] for name, p in prompts.items()}
    return {"oracle": ("random", lambda k: OracleDrafter(expected)),
            "ngram": ("copy-heavy", lambda k: NgramDrafter(1, 4)),
            "draft": ("random", lambda k: DraftModelDrafter(draft[0], draft[1], max_num_seqs=1,
                                                            block_size=core.scheduler.config.block_size,
                                                            kv_capacity_tokens=core.max_model_len, k=k)),
            "mtp": ("copy-heavy" if llm.tokenizer is not None and llm.tokenizer.chat_template else "random",
                    lambda k: MtpDrafter(core.runner, core.scheduler.blocks))}


def run(args: argparse.Namespace) -> int:
    import torch

    from kvstate.bench.timing import silence_expected_warnings
    from kvstate.engine.speculative.config import SpeculativeConfig
    from kvstate.terminal.console import make_console

    if args.threads:
        torch.set_num_threads(args.threads)
    silence_expected_warnings()
    console = make_console(stderr=args.json)
    ks = _ks(args)
    plen = args.prompt_len or (32 if args.quick else 128)
    new = args.new_tokens or (16 if args.quick else 64)
    llm, methods, draft = _engine(args, args.methods.split(","), plen, new, console)
    g = torch.Generator().manual_seed(0)
    prompts = {"random": torch.randint(0, llm.plan.vocab_size, (plen,), generator=g).tolist(),
               "copy-heavy": copy_prompt(llm, plen, new, g)}
    rows, plain = [], {}
    _race(llm, prompts["random"][:8], {"run": None}, new, args.repeats)  # warm up
    for name, prompt in prompts.items():
        with console.status(f"plain decode, {name} prompt"):
            plain[name] = _race(llm, prompt, {"run": None}, new, args.repeats)["run"][:2]
    drafters = _drafters(llm, prompts, plain, draft)
    for method in methods:
        which, make_drafter = drafters[method]
        for k in ([1, 2, 3] if method == "mtp" else ks):
            cfg = SpeculativeConfig("ngram", k)
            with console.status(f"{method}, k={k}"):
                # plain in turn with it, on the same prompt (`_race`)
                got = _race(llm, prompts[which], {"spec": lambda: (cfg, make_drafter(k)), "plain": None}, new,
                            args.repeats)
                (tps, tokens, prop), base_tps = got["spec"], got["plain"][0]
            st = prop.stats()
            rows.append(dict(method=method, prompt=which, k=k, acceptance=st["spec_acceptance_rate"],
                             tokens_per_step=st["spec_mean_accepted_length"], tokens_per_s=tps,
                             plain_tokens_per_s=base_tps, speedup=tps / base_tps, exact=tokens == plain[which][1]))
    llm.engine.set_proposer(None)
    name = f"random Qwen3.5-style {'quick' if args.quick else '0.5b'}" if args.model is None else str(args.model)
    result = dict(model=f"{name} ({llm.plan.params.total / 1e9:.3g}B, {llm.plan.layer_string})",
                  prompt_tokens=plen, new_tokens=new, threads=torch.get_num_threads(),
                  plain_tokens_per_s={k: v[0] for k, v in plain.items()}, rows=rows)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print(console, result)
    return 0


def _print(console, result: dict) -> None:
    from rich.table import Table

    console.print(f"{result['model']}; batch 1, greedy, {result['new_tokens']} new tokens; fp32, "
                  f"{result['threads']} threads; "
                  + ", ".join(f"plain {k} prompt {v:.1f} tok/s" for k, v in result["plain_tokens_per_s"].items()),
                  soft_wrap=True)
    table = Table(title="kvstate bench speculative")
    for col in ("drafter", "prompt", "k", "acceptance", "tokens/step", "tok/s", "vs plain", "exact"):
        table.add_column(col, justify="left" if col in ("drafter", "prompt") else "right")
    for r in result["rows"]:
        table.add_row(r["method"], r["prompt"], str(r["k"]), f"{100 * r['acceptance']:.0f}%",
                      f"{r['tokens_per_step']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
                      "yes" if r["exact"] else "NO")
    console.print(table)
