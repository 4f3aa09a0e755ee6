"""Load a Hugging Face checkpoint (config.json + *.safetensors) into the generic hybrid decoder.

The family adapter translates the config into the layer plan and model options, and each
checkpoint tensor name into targets in our parameters. Every parameter must be filled
completely and every tensor must have a home: otherwise a KvstateError names what is wrong.
Activations, states and small weights are float32. The projection, expert and embedding
matrices are stored in `weight_dtype`: by default bf16 when the checkpoint's matrices are bf16
(copied as they are, no fp32 copy), float32 otherwise; the kernels widen bf16 exactly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from kvstate.families import read_plan
from kvstate.config.dtypes import (QUANTIZED_WEIGHT_DTYPES, WEIGHT_DTYPES, WEIGHT_DTYPES_EXPECTED,
                                   canonical_weight_dtype)
from kvstate.config.fields import ConfigView
from kvstate.errors import KvstateError
from kvstate.families import adapter
from kvstate.gguf import is_gguf
from kvstate.gguf.checkpoint import gguf_file
from kvstate.gguf.metadata import open_reader
from kvstate.gguf.tensors import open_tensors
from kvstate.gguf.weights import Blocks, hf_tensors, matrix_dtype
from kvstate.hub import resolve_checkpoint
from kvstate.kernels.hugepages import place_weights
from kvstate.kernels.ggml_blocks import TYPES, dequantize
from kvstate.kernels.quant import eligible_linears, quantize_linears
from kvstate.models.build import build_model, fuse_projections, set_weight_dtype
from kvstate.models.family import RunnableFamily
from kvstate.models.gguf_blocks import BlockPlan, dequantized_line, finish_blocks, plan_blocks, to_meta_blocks


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint folder: its safetensors shards, or the GGUF file it stands for."""
    if (gguf := gguf_file(path)) is not None:
        return [gguf]
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise KvstateError(f"{index}: malformed safetensors index ({exc})") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise KvstateError(f"{index}: names shard {missing[0]}, which is not in {path}"
                               + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""))
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise KvstateError(f"{path}: no *.safetensors files")
    return files


def family_of(plan) -> RunnableFamily:
    family = adapter(plan.model_type)
    if not isinstance(family, RunnableFamily):
        raise KvstateError(f"{plan.source or plan.name}: model_type {plan.model_type!r} can be planned but not run")
    return family


def weight_dtype_of(name: str | torch.dtype | None) -> torch.dtype | None:
    """A weight dtype from any spelling `kvstate memory` takes ("bf16", "float32", torch.bfloat16),
    or "int8", or torch.uint8 for GGML blocks ("q8_0", "q4_0", "q4_k"); None for None (the
    checkpoint's); anything else is one KvstateError."""
    if name is None or isinstance(name, torch.dtype):
        canonical = None if name is None else str(name).removeprefix("torch.")
    else:
        canonical = canonical_weight_dtype(name)
    if name is not None and canonical not in WEIGHT_DTYPES:
        raise KvstateError(f"weight dtype {name!r}: {WEIGHT_DTYPES_EXPECTED}")
    if canonical in QUANTIZED_WEIGHT_DTYPES and canonical != "int8":
        return torch.uint8
    return None if canonical is None else getattr(torch, canonical)


def checkpoint_weight_dtype(files: list, kept: frozenset[str] = frozenset()) -> torch.dtype:
    """bfloat16 when the checkpoint's matrices (2-D and larger tensors) are mostly bf16, else float32
    (`files`: safetensors files, or one GGUF file or its open reader, whose matrices named in `kept`,
    held as blocks, do not count)."""
    if hasattr(files[0], "tensors") or is_gguf(files[0]):
        return matrix_dtype(files[0], kept)
    sizes = {"BF16": 0, "other": 0}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    shape = part.get_shape()
                    if len(shape) >= 2:
                        kind = "BF16" if part.get_dtype() == "BF16" else "other"
                        sizes[kind] += int(torch.tensor(shape).prod())
        except Exception:  # a broken file is reported by the load itself, naming it
            return torch.float32
    return torch.bfloat16 if sizes["BF16"] > sizes["other"] else torch.float32


def has_mtp_weights(files: list[Path]) -> bool:
    """Whether the checkpoint holds multi-token-prediction tensors (`mtp.*`; headers only)."""
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                if any(key.startswith("mtp.") for key in f.keys()):
                    return True
    except Exception:  # a broken file is reported by the load itself, naming it
        pass
    return False


def open_checkpoint(path: str | Path):
    """-> (directory, plan, family adapter, model options, safetensors files) of a checkpoint directory
    or hub id: what building and loading a model (whole, or one tensor-parallel rank's part) starts from."""
    path = resolve_checkpoint(path)
    if not path.is_dir():
        raise KvstateError(f"{path}: not a checkpoint directory")
    plan = read_plan(path)
    family = family_of(plan)
    return path, plan, family, family.model_options(ConfigView(plan.config, plan.source)), safetensors_files(path)


def _target_sources(tensor, targets, params) -> list:
    """(target, what it copies): a block Linear takes a `Blocks` tensor's rows, any other target its
    weights, dequantized once for all of them; a plain tensor goes to every target as it is."""
    if not isinstance(tensor, Blocks):
        return [(t, tensor) for t in targets]
    weights, out = None, []
    for t in targets:
        if params[t.name].dtype == torch.uint8:
            out.append((t, tensor.raw))
        else:
            weights = dequantize(tensor.raw, tensor.qtype) if weights is None else weights
            out.append((t, weights))
    return out


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32,
               progress: Callable[[int, int], None] | None = None, weight_dtype=None):
    """-> (model in eval mode, plan). `path` is a checkpoint directory or a hub id (kvstate.hub).

    `progress(bytes_done, bytes_total)`, if given, is called as tensors load (for a progress bar).
    `weight_dtype` ("bf16", "fp32", a torch dtype; None: the checkpoint's) stores the big matrices
    (`set_weight_dtype`); with an activation `dtype` other than float32 the weights follow `dtype`.
    "int8" loads the checkpoint's dtype, then stores the projections as int8 with per-row scales
    (`kernels.quant`; embeddings and experts stay as loaded); "q8_0", "q4_0", "q4_k" as GGML's
    blocks (`kernels.blocks`) the same way. A GGUF file's quantized projections keep the file's
    blocks (`models.gguf_blocks`) unless `weight_dtype` names a float dtype or `dtype` is not float32."""
    path, plan, family, opts, files = open_checkpoint(path)
    wanted = weight_dtype_of(weight_dtype)
    quantize = wanted in (torch.int8, torch.uint8)
    if quantize and dtype != torch.float32:
        raise KvstateError(f"{canonical_weight_dtype(weight_dtype)} weights take float32 activations "
                           "(the kernels' math)")
    model = build_model(plan, opts, device="meta", mtp=bool(plan.mtp) and has_mtp_weights(files))
    model.to(dtype)  # on meta: nothing is allocated yet
    blocks = BlockPlan()
    targets_of = lambda key: family.weight_targets(key, plan)  # noqa: E731
    sources = files  # a GGUF file is opened once (reading its metadata takes seconds)
    if is_gguf(files[0]):
        sources = [_gguf_tensor_source(files[0])]
        keep = dtype == torch.float32 and (wanted is None or quantize)  # a float dtype asked for: dequantize
        blocks = plan_blocks(model, sources[0], plan.config, targets_of, keep)
    matrices = dtype  # the dtype of the float matrices (what a dequantized tensor becomes)
    if dtype == torch.float32:
        matrices = (None if quantize else wanted) or checkpoint_weight_dtype(sources, blocks.kept)
        set_weight_dtype(model, matrices)
    to_meta_blocks(model, blocks)
    model.to_empty(device="cpu")
    if plan.tie_word_embeddings:  # to_empty gives each module its own tensor: tie the head again
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters())
    params.update(model.named_buffers())
    filled = {name: 0 for name in params}
    layout: dict[str, tuple[int, ...]] = {}  # checkpoint name -> shape, to save in the same layout
    total, done = sum(f.stat().st_size for f in files), 0
    for file, source in zip(files, sources):
        for key, targets, tensor in _tensors(file, targets_of, plan.model_type, plan.config, blocks.blocks, source):
            raw = tensor.raw if isinstance(tensor, Blocks) else tensor
            layout[key] = tuple(raw.shape)
            if progress is not None:
                done += raw.numel() * raw.element_size()
                progress(min(done, total), total)
            for t, source in _target_sources(tensor, targets, params):
                copy_weight(params, filled, t, source, key, file.name, plan)
    if progress is not None:
        progress(total, total)
    if plan.tie_word_embeddings:
        filled.pop("lm_head.weight", None)
    missing = [n for n, count in filled.items() if count < params[n].numel()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        where = files[0].resolve() if is_gguf(files[0]) else path  # the GGUF file, not the folder standing for it
        raise KvstateError(f"{where}: checkpoint is missing tensors for {shown}")
    finish_blocks(model, blocks)
    if line := dequantized_line(files[0].resolve(), blocks, matrices):
        print(line, file=sys.stderr)
    if quantize:
        name = canonical_weight_dtype(weight_dtype)
        eligible = len(eligible_linears(model))
        if (done := quantize_linears(model, name)) < eligible and name != "int8":  # rows not a multiple of the block
            print(f"{path}: --weight-dtype {name} quantized {done} of {eligible} projections (the rest have rows "
                  f"that are not a multiple of its {TYPES[name.upper()].block}-weight block and keep "
                  f"{str(model.lm_head.weight.dtype).removeprefix('torch.')})", file=sys.stderr)
    fuse_projections(model)  # GDN's four input projections, q/k/v, gate/up: one kernel call each
    place_weights(model)  # the streamed matrices on huge pages (faster decode), where the OS has them
    model.eval()
    model.checkpoint_layout = layout
    model.hf_config = json.loads((path / "config.json").read_text())
    return model, plan


def _tensors(file: Path, targets_of, model_type: str, config: dict, blocks: frozenset[str] = frozenset(),
             source=None):
    """(name, targets, tensor) of each checkpoint tensor that has targets in our model (a GGUF file's,
    read from `source`, its open reader: those named in `blocks` as `Blocks`); a file that is not valid
    safetensors (truncated, garbage) is one KvstateError naming it."""
    if is_gguf(file):
        yield from _gguf_tensors(file, targets_of, model_type, config, blocks, source or file)
        return
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                targets = targets_of(key)
                if targets is None:
                    raise KvstateError(f"{file.name}: tensor {key!r} is not part of a {model_type} model")
                if targets:
                    yield key, targets, f.get_tensor(key)
    except KvstateError:
        raise
    except Exception as exc:  # safetensors raises SafetensorError (a bare Exception subclass) or OSError
        raise KvstateError(f"{file}: not a valid safetensors file ({str(exc).splitlines()[0][:120]})") from None


def _gguf_tensors(file: Path, targets_of, model_type: str, config: dict, blocks: frozenset[str], source):
    for key, tensor in hf_tensors(source, config, blocks):
        targets = targets_of(key)
        if targets is None:
            raise KvstateError(f"{file.name}: tensor {key!r} is not part of a {model_type} model")
        if targets:
            yield key, targets, tensor


def _gguf_tensor_source(link: Path):
    """The tensors of the GGUF file a checkpoint folder links to: its folder's table (no metadata parse),
    else the file opened with gguf's reader."""
    try:
        table = open_tensors(link)
    except (OSError, ValueError) as exc:
        raise KvstateError(f"{link.resolve()}: not a readable GGUF file ({str(exc)[:120]})") from None
    return table if table is not None else open_reader(link.resolve())


def _config_hint(plan, expected: tuple[int, ...], got: tuple[int, ...]) -> str:
    """Which config.json fields a shape disagreement points at: the integer fields equal to an
    expected size the weights do not have (hidden_size first, the most common culprit)."""
    sizes = {e for e, g in zip(expected, got) if e != g} if len(expected) == len(got) else set(expected) - set(got)
    fields = [k for k, v in plan.config.items() if type(v) is int and v in sizes]
    fields.sort(key=lambda k: k != "hidden_size")
    if not fields:
        return ""
    shown = " or ".join(f"{k} = {plan.config[k]}" for k in fields[:3])
    return f"; config.json's {shown} disagrees with the weights"


def copy_weight(params, filled, target, tensor, key, file, plan):
    if target.name not in params:
        raise KvstateError(f"{file}: tensor {key!r} maps to {target.name!r}, which this model does not have")
    dest = params[target.name]
    rows = list(target.rows) if isinstance(target.rows, tuple) else target.rows
    src = tensor if rows is None else tensor[rows]
    view = dest[target.index] if target.index else dest
    if tuple(src.shape) != tuple(view.shape):
        if src.numel() != view.numel() or [d for d in src.shape if d != 1] != [d for d in view.shape if d != 1]:
            raise KvstateError(f"{file}: tensor {key!r} has shape {tuple(tensor.shape)}, expected "
                               f"{tuple(view.shape)} for {target.name}"
                               + _config_hint(plan, tuple(view.shape), tuple(src.shape)))
        src = src.reshape(view.shape)  # e.g. depthwise conv1d weight [D, 1, W] -> [D, W]
    with torch.no_grad():
        view.copy_(src)
    filled[target.name] += view.numel()
