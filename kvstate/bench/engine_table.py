"""The human form of `kvstate bench engine`'s result (what --json prints): the table of our rows and
llama.cpp's, the ratios, int8's logit error, then the decode-step breakdown."""

from __future__ import annotations


def show(console, result: dict) -> None:
    """The human form of `result` (what --json prints): one table of every row, ours and llama.cpp's,
    the ratios, then the decode-step breakdown."""
    from rich.table import Table

    m = result["machine"]
    pools = result.get("cache_dtypes") or {}
    console.print(f"{result['model']}; prompts {result['prompt_tokens']} tokens, {result['new_tokens']} new; "
                  f"weights {result['weight_dtype']}, activations {result.get('activation_dtype', 'fp32')}, "
                  f"KV pools {pools.get('kv', '?')} (states "
                  f"{pools.get('state', '?')}), {m['threads']} threads; machine: read "
                  f"{m['read_bandwidth_gbps']:.1f} GB/s (sum of 1 GiB), copy {m['bandwidth_gbps']:.1f} GB/s, "
                  f"fp32 GEMM {m['gemm_gflops']:.1f} GFLOP/s; "
                  + (f"huge pages off: {m['huge_pages_off']}" if m.get("huge_pages_off") else
                     f"{m.get('huge_page_bytes', 0) / 2**30:.2f} GiB of weights and caches on 2 MiB pages"),
                  soft_wrap=True)
    table = Table(title="kvstate bench engine")
    for col in ("impl", "phase", "batch", "tokens/s", "ms/step", "GB/s", "% read BW"):
        table.add_column(col, justify="left" if col in ("impl", "phase") else "right")
    for r in result["rows"]:
        impl = r["impl"] if r["impl"] != "kvstate" else f"kvstate {result['weight_dtype']}"
        table.add_row(impl, r["phase"], str(r["batch"]), f"{r['tokens_per_s']:,.1f}" if r["tokens_per_s"] else "-",
                      f"{r['ms_per_step']:.1f}" if r["ms_per_step"] else "-",
                      f"{r['gbps']:.1f}" if r["gbps"] else "-",
                      f"{100 * r['bandwidth_fraction']:.0f}%" if r["bandwidth_fraction"] else "-")
    for r in result["llama_cpp"]:
        decode = r["test"].startswith("tg")
        gbps = r["streamed_bytes"] * r["tokens_per_s"] / 1e9 if decode else None
        table.add_row(f"llama.cpp {r['gguf']}", "decode" if decode else "prefill", "1", f"{r['tokens_per_s']:,.1f}",
                      f"{1e3 / r['tokens_per_s'] * (1 if decode else int(r['test'][2:])):.1f}",
                      f"{gbps:.1f}" if gbps else "-",
                      f"{100 * gbps / m['read_bandwidth_gbps']:.0f}%" if gbps else "-")
    console.print(table)
    q = result.get("quant_logit_error")  # quantized weights (int8, q8_0, q4_k, a quantized GGUF file)
    if q:
        console.print(f"{result['weight_dtype']} weights vs {q['baseline']}, one {q['positions']}-token prompt: "
                      f"KL divergence {q['kl']:.5f} nats (worst position {q['max_kl']:.5f}), top-1 token the same "
                      f"at {100 * q['top1']:.1f}% of positions, logits {100 * q['rel']:.2f}% relative error")
    elif result.get("quant_baseline_missing"):
        console.print(result["quant_baseline_missing"])
    for key, rows in (("activation_logit_error", "the decode kernels"), ("activation_logit_error_prefill",
                                                                          "the prefill GEMMs")):
        a = result.get(key)
        if a:
            console.print(f"{result['activation_dtype']} activations vs fp32 math, same weights, one "
                          f"{a['positions']}-token prompt ({rows}): logits {100 * a['rel']:.3f}% relative error "
                          f"(worst position {100 * a['max_rel']:.3f}%), top-1 token the same at "
                          f"{100 * a['top1']:.1f}% of positions")
    for k, v in result["speedup_vs_transformers"].items():
        console.print(f"kvstate / transformers, {k}: {v:.2f}x")
    batches = sorted({r["batch"] for r in result["rows"] if r["phase"] == "decode"})
    if result["decode_scaling"]:
        console.print(f"kvstate decode throughput, batch {batches[-1]} / batch {batches[0]}: "
                      f"{result['decode_scaling']:.1f}x")
    sr = result.get("decode_step_rounds")
    if sr:
        low, high = sr["batches"]
        console.print(f"kvstate decode step, batch {high} / batch {low}, {len(sr['ratios'])} alternating rounds: "
                      f"median {sr['median']:.3f}x ({', '.join(f'{r:.3f}' for r in sr['ratios'])})")
    if result["llama_cpp"]:
        r = result["llama_cpp"][0]
        console.print(f"llama.cpp: llama-bench -t {r['threads']} -p {result['prefill_tokens']} "
                      f"-n {result['llama_gen']}")
    for k, v in result["vs_llama_cpp"].items():
        console.print(f"kvstate ({result['weight_dtype']}) / llama.cpp, {k}: {v:.2f}x")
    for k, v in result.get("vs_llama_cpp_rounds", {}).items():
        console.print(f"kvstate ({result['weight_dtype']}) / llama.cpp, {k}, {len(v['ratios'])} alternating rounds: "
                      f"median {v['median']:.2f}x ({', '.join(f'{r:.2f}' for r in v['ratios'])})")
    from kvstate.bench.depth import show as show_depth

    show_depth(console, result)
    if result["step_profile"]:
        from kvstate.bench.step_profile import profile_table

        console.print(profile_table(result["step_profile"], result["weight_bytes"]))
