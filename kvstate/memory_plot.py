"""`kvstate memory --plot`: log-log chart of cache bytes per request against context length.

For one model, the three curves of the Qwen3.5 walkthrough (spec 002): a hypothetical model with
MHA on every layer, one with its own GQA (or MLA) attention on every layer, and the actual hybrid,
plus a marker where the hybrid's KV overtakes its fixed state. For several models, one actual
curve each with its marker. matplotlib is imported here only, when a chart is asked for.
"""

from __future__ import annotations

from pathlib import Path

from kvstate.cache.spec import CacheSpec
from kvstate.terminal.plot_path import FORMATS, check_plot_path
from kvstate.config.dtypes import dtype_bytes
from kvstate.config.plan import KV_KINDS, AttentionSpec, MLASpec, ModelPlan
from kvstate.errors import KvstateError
from kvstate.memory import crossover_tokens, format_bytes, format_tokens


def hypothetical_curves(plan: ModelPlan, kv_dtype: str) -> dict[str, int]:
    """Bytes per token if every layer were the model's attention, as MHA and as it is.

    Empty when the model has no attention layer to generalize."""
    attn = next((m for layer in plan.layers for m in layer.mixers if isinstance(m, (AttentionSpec, MLASpec))), None)
    if attn is None:
        return {}
    size, n = dtype_bytes(kv_dtype), plan.num_layers
    if isinstance(attn, AttentionSpec):
        mha = n * 2 * attn.num_heads * attn.head_dim * size
        own = n * 2 * attn.num_kv_heads * attn.head_dim * size
        label = "MHA" if attn.num_kv_heads == attn.num_heads else "GQA"
    else:  # MLA expanded to plain heads: K of nope + rope dims, V of v_head_dim
        mha = n * attn.num_heads * (attn.qk_nope_head_dim + attn.qk_rope_head_dim + attn.v_head_dim) * size
        own = n * (attn.kv_lora_rank + attn.qk_rope_head_dim) * size
        label = "MLA"
    curves = {f"MHA on all {n} layers (hypothetical)": mha}
    if label != "MHA":
        curves[f"{label} on all {n} layers (hypothetical)"] = own
    return curves


def _token_grid(lo: int, hi: int) -> list[int]:
    """Points from lo to hi, four per doubling."""
    points, t = [], float(lo)
    while t < hi:
        points.append(int(t))
        t *= 2 ** 0.25
    return points + [hi]


def plot(models: list[tuple[ModelPlan, CacheSpec]], path: str | Path, contexts: tuple[int, ...]) -> Path:
    """Write the chart to `path` (.png or .svg) and return the path."""
    path = check_plot_path(path)
    fmt = FORMATS[path.suffix.lower()]
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise KvstateError("--plot needs matplotlib: pip install 'kvstate[plot]'") from None

    limits = [p.max_position_embeddings or 0 for p, _ in models]
    hi = max([*contexts, *limits, 1 << 17])
    grid = _token_grid(64, hi)
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    ax = fig.add_subplot()
    single = len(models) == 1
    for plan, spec in models:
        if single:
            for label, per_token in hypothetical_curves(plan, spec.kv_dtype).items():
                ax.plot(grid, [per_token * t for t in grid], linestyle="--", label=label)
        kv_layers = sum(1 for layer in plan.layers if set(layer.kinds) & KV_KINDS)
        label = f"{plan.name} (actual: KV in {kv_layers} of {plan.num_layers} layers)" if single else plan.name
        line, = ax.plot(grid, [spec.request_bytes(t) for t in grid], linewidth=2.2, label=label)
        cross = crossover_tokens(spec)
        if cross is not None:
            ax.plot([cross], [spec.request_bytes(cross)], marker="o", color=line.get_color(), markersize=7)
            if single:
                ax.annotate(f"KV overtakes the fixed state\n({format_bytes(spec.state_bytes)}) at "
                            f"{cross:,.0f} tokens", (cross, spec.request_bytes(cross)),
                            textcoords="offset points", xytext=(12, -28), fontsize=9)
    for c in contexts:
        ax.axvline(c, color="0.8", linewidth=0.8, zorder=0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_tokens(int(x)) if x >= 1 else ""))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: format_bytes(y) if y >= 1 else ""))
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("cache per request")
    dtypes = {(s.kv_dtype, s.state_dtype) for _, s in models}
    note = ", ".join(f"KV {k}, state {s}" for k, s in sorted(dtypes))
    ax.set_title(f"Cache per request vs context ({note})")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    try:
        fig.savefig(path, format=fmt)
    except OSError as exc:
        raise KvstateError(f"--plot: {path}: {exc.strerror or exc}") from None
    return path
