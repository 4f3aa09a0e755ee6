"""`EngineConfig`: every setting of an engine, written once (no torch).

    config = EngineConfig(cache_memory="4GiB", enable_prefix_caching=True)
    LLM(model, **fields)  ->  EngineConfig(**fields)  ->  EngineCore(model, plan, tokenizer, config)

Each field's metadata holds its one help text (and, where the flag is not `--field-name`, its
flags); `kvstate.terminal.engine_args` makes the `generate` / `serve` options from them, so a
new setting is one field here plus its use.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvstate.engine.speculative.config import SpeculativeConfig
from kvstate.errors import KvstateError

# the precisions of bf16-weight linears (kernels.activation.PARTS: the kernels' names for them)
ACTIVATION_DTYPES = ("fp32", "bf16", "bf16x3", "q8")


def _setting(default, help: str, *, flags: tuple[str, ...] = (), metavar: str | None = None,
             shown: str | None = None):
    """A field with its help; `flags` (first one shown) default to --field-name; `shown`: the
    default as the help says it where the value alone does not say it."""
    return field(default=default, metadata={"help": help, "flags": flags, "metavar": metavar, "shown": shown})


@dataclass
class EngineConfig:
    cache_memory: int | str | None = _setting(
        None, "KV + state pool budget, e.g. 4GiB", metavar="SIZE", shown="a fraction of the free memory")
    block_size: int = _setting(16, "tokens per KV block", metavar="N")
    max_num_seqs: int = _setting(32, "most requests running at once (and state slots)", metavar="N")
    max_num_batched_tokens: int = _setting(2048, "most tokens computed in one engine step", metavar="N")
    max_model_len: int | None = _setting(
        None, "longest prompt + output in tokens, at most the model's", metavar="N",
        shown="the model's max_position_embeddings")
    conv_window: str = _setting("kernel", "conv state columns kept per slot: 'kernel' (as transformers) or 'kernel-1'")
    seed: int | None = _setting(None, "random seed: the same seed gives the same tokens; requests that give no "
                                      "seed use it", metavar="N", shown="fresh randomness")
    enable_prefix_caching: bool = _setting(
        False, "reuse the KV blocks and state snapshots of earlier prompts and replies that share a prefix "
               "(hits in the summary and /metrics)", flags=("--enable-prefix-caching", "--prefix-caching"))
    snapshot_interval: int | str | None = _setting(
        "auto", "with prefix caching, also snapshot the state every N prompt tokens; 'auto': 256, doubled "
                "until a prompt holds at most 8", metavar="N")
    snapshot_memory: int | str | None = _setting(
        None, "with prefix caching, the bytes of --cache-memory that state snapshots may hold (e.g. 256MiB; "
              "`kvstate memory MODEL --snapshots N` shows what N cost)", metavar="SIZE",
        shown="2 per --max-num-seqs within half of --cache-memory")
    num_snapshot_slots: int | None = _setting(
        None, "with prefix caching, spare state slots for snapshots (instead of --snapshot-memory)", metavar="N",
        shown="2 per --max-num-seqs within half of --cache-memory")
    snapshot_repeat: bool = _setting(True, "with prefix caching, snapshot at prompt length - 1 (a repeated prompt "
                                           "resumes there)")
    prefix_eviction: str = _setting("marconi", "snapshot eviction: 'marconi' (FLOPs saved per byte) or 'lru'")
    prefix_align: int = _setting(
        1, "with prefix caching, snapshot only at multiples of N tokens (1024: vLLM's block-aligned policy)",
        metavar="N")
    speculative_config: SpeculativeConfig | dict | None = _setting(
        None, "speculative decoding: vLLM's dict, e.g. {\"method\": \"ngram\", \"num_speculative_tokens\": 4} "
              "(parsed once into a SpeculativeConfig)", metavar="JSON")
    weight_dtype: str | None = _setting(
        None, "keep the weight matrices in bf16 or fp32, or the projections in int8 with per-row scales, or in "
              "GGML's q8_0, q4_0 or q4_k blocks; math stays fp32", metavar="DTYPE", shown="the checkpoint's")
    activation_dtype: str = _setting(
        "fp32", "bf16 weights on CPUs with AVX512_BF16 (Zen 4 and later): fp32 math (exact), bf16 (each linear's "
                "input rounded to bf16, as llama.cpp's bf16; faster, logits ~2% off) or bf16x3 (near-exact); GGML "
                "block weights: q8 (x quantized to 8 bits per block, integer dot products, as llama.cpp); "
                "process-wide", metavar="DTYPE")
    tensor_parallel_size: int = _setting(
        1, "shard the model and its caches over N processes (tensor parallelism); --cache-memory is then per "
           "process", flags=("--tp", "--tensor-parallel-size"), metavar="N")

    def __post_init__(self):
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise KvstateError(f"activation_dtype {self.activation_dtype!r}: expected one of "
                               f"{', '.join(ACTIVATION_DTYPES)}")
        if self.speculative_config is not None:  # one error here, before any weights load
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)


SETTINGS = {f.name: f for f in fields(EngineConfig)}
