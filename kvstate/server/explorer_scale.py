"""The explorer's prefill-against-decode panel at real scale: spec 002's scenario from measured rates.

The document's timeline (1,024 prompt tokens, then 256 decoded) is computed from a real-size
model's rates on this machine: the prefill and batch-1 decode rows of `kvstate bench engine --json`
(by default a random Qwen3.5-style 0.5B checkpoint). The result comes from a saved JSON (`kvstate
serve --bench-json FILE`, or uploaded from the page) or from one run started from the page
(`BenchRun`: the CLI in a subprocess, one at a time, with a time limit; the server keeps serving).

    prefill  = PROMPT / prefill tokens per s                 (one parallel pass)
    decode   = NEW x batch-1 ms per step                     (one step per token)
    TTFT     = prefill + one decode step; total = prefill + decode
    ratio    = decode ms per token / prefill ms per token

Bytes each step reads: a decode step reads every weight once for one token (weight_bytes, plus the
state and KV: the bench's GB/s x step time); prefill reads the same weights once for all PROMPT
tokens, weight_bytes / PROMPT per token. The bench measures prefill at its --prefill-len (this
page's run: 1,024, the scenario's prompt).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time

from kvstate.errors import KvstateError

PROMPT, NEW = 1024, 256
COMMAND = [sys.executable, "-m", "kvstate", "bench", "engine", "--json", "--no-reference", "--batches", "1",
           "--prefill-len", str(PROMPT), "--new-tokens", "16"]
TIME_LIMIT = 1800.0


def _figure(value, name: str, most: float, *, optional: bool = False) -> float | None:
    """A measured figure: a finite number in (0, most] (an upload may hold NaN, Infinity or 1e-400)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= most \
            or not math.isfinite(value):
        raise KvstateError(f"the bench result's {name} must be a number in (0, {most:g}], got {value!r:.40}")
    return float(value)


def _text(value, name: str) -> str | None:
    if value is not None and not (isinstance(value, str) and len(value) <= 200):
        raise KvstateError(f"the bench result's {name} must be a short string, got {type(value).__name__}")
    return value


def _row(bench: dict, phase: str) -> dict:
    rows = bench.get("rows", [])
    rows = [r for r in rows if isinstance(r, dict) and r.get("impl") == "kvstate"
            and r.get("phase") == phase and (phase == "prefill" or r.get("batch") == 1)] \
        if isinstance(rows, list) else []
    if not rows or not rows[0].get("tokens_per_s") or not rows[0].get("ms_per_step"):
        what = "prefill" if phase == "prefill" else "batch-1 decode"
        raise KvstateError(f"the bench result has no measured kvstate {what} row: is it `kvstate bench engine "
                           "--json` output with batch 1 in --batches?")
    row = rows[0]
    return {"tokens_per_s": _figure(row["tokens_per_s"], f"{phase} tokens_per_s", 1e9),
            "ms_per_step": _figure(row["ms_per_step"], f"{phase} ms_per_step", 1e7),
            "gbps": _figure(row.get("gbps") or None, f"{phase} gbps", 1e5, optional=True)}


def scenario(bench: dict, prompt: int = PROMPT, new: int = NEW) -> dict:
    """The document's timeline from a `kvstate bench engine --json` result."""
    if not isinstance(bench, dict):
        raise KvstateError("the bench result must be a JSON object (`kvstate bench engine --json`)")
    pre, dec = _row(bench, "prefill"), _row(bench, "decode")
    machine = bench.get("machine") or {}
    if not isinstance(machine, dict):
        raise KvstateError("the bench result's machine must be an object")
    threads = machine.get("threads")
    threads = None if threads is None else int(_figure(threads, "machine.threads", 1 << 16))
    measured = bench.get("prefill_tokens")
    measured = None if measured is None else int(_figure(measured, "prefill_tokens", 1 << 24))
    prefill_tok_ms = 1e3 / pre["tokens_per_s"]
    decode_ms = dec["ms_per_step"]
    prefill_ms = prompt * prefill_tok_ms
    decode_total = new * decode_ms
    total = prefill_ms + decode_total
    weights = int(_figure(bench.get("weight_bytes") or None, "weight_bytes", 1e15, optional=True) or 0)
    step_bytes = dec["gbps"] * 1e9 * decode_ms / 1e3 if dec.get("gbps") else None
    return {"model": _text(bench.get("model"), "model"),
            "weight_dtype": _text(bench.get("weight_dtype"), "weight_dtype"),
            "threads": threads, "prompt_tokens": prompt, "new_tokens": new,
            "measured_prefill_tokens": measured,
            "prefill_tokens_per_s": pre["tokens_per_s"], "prefill_ms_per_token": prefill_tok_ms,
            "decode_ms_per_token": decode_ms, "prefill_ms": prefill_ms, "decode_ms": decode_total,
            "ttft_ms": prefill_ms + decode_ms, "total_ms": total, "prefill_share": prefill_ms / total,
            "decode_share": decode_total / total, "ratio": decode_ms / prefill_tok_ms, "weight_bytes": weights,
            "decode_step_bytes": step_bytes, "prefill_bytes_per_token": weights / prompt if weights else None}


class BenchRun:
    """One `kvstate bench engine --json` at a time, in a subprocess watched by a thread."""

    def __init__(self, command: list[str] | None = None, time_limit: float = TIME_LIMIT):
        self.command, self.time_limit = command or COMMAND, time_limit
        self.state = {"status": "idle"}
        self.result: dict | None = None
        self._lock = threading.Lock()
        self.proc: subprocess.Popen | None = None

    def start(self) -> dict:
        with self._lock:
            if self.state["status"] == "running":
                return self.state
            self.state = {"status": "running", "started": time.time(), "command": " ".join(self.command[1:])}
        threading.Thread(target=self._run, name="kvstate-explorer-bench", daemon=True).start()
        return self.state

    def stop(self) -> None:
        """Kill a run in progress (the server is stopping: no bench outlives it)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def _run(self) -> None:
        try:
            self.proc = proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                 text=True)
            try:
                out, err = proc.communicate(timeout=self.time_limit)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
            if proc.returncode != 0:
                raise KvstateError((err.strip().splitlines() or [f"exit {proc.returncode}"])[-1])
            result = json.loads(out)
            scenario(result)  # refuse a result the panel cannot use
            self.result = result
            state = {"status": "done", "seconds": time.time() - self.state["started"]}
        except subprocess.TimeoutExpired:
            state = {"status": "failed", "error": f"the bench ran past {self.time_limit:.0f} s"}
        except (KvstateError, ValueError, OSError) as exc:
            state = {"status": "failed", "error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}
        with self._lock:
            self.state = state
