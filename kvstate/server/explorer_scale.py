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
import subprocess
import sys
import threading
import time

from kvstate.errors import KvstateError

PROMPT, NEW = 1024, 256
COMMAND = [sys.executable, "-m", "kvstate", "bench", "engine", "--json", "--no-reference", "--batches", "1",
           "--prefill-len", str(PROMPT), "--new-tokens", "16"]
TIME_LIMIT = 1800.0


def _row(bench: dict, phase: str) -> dict:
    rows = [r for r in bench.get("rows", []) if isinstance(r, dict) and r.get("impl") == "kvstate"
            and r.get("phase") == phase and (phase == "prefill" or r.get("batch") == 1)]
    if not rows or not rows[0].get("tokens_per_s") or not rows[0].get("ms_per_step"):
        what = "prefill" if phase == "prefill" else "batch-1 decode"
        raise KvstateError(f"the bench result has no measured kvstate {what} row: is it `kvstate bench engine "
                           "--json` output with batch 1 in --batches?")
    return rows[0]


def scenario(bench: dict, prompt: int = PROMPT, new: int = NEW) -> dict:
    """The document's timeline from a `kvstate bench engine --json` result."""
    if not isinstance(bench, dict):
        raise KvstateError("the bench result must be a JSON object (`kvstate bench engine --json`)")
    pre, dec = _row(bench, "prefill"), _row(bench, "decode")
    prefill_tok_ms = 1e3 / float(pre["tokens_per_s"])
    decode_ms = float(dec["ms_per_step"])
    prefill_ms = prompt * prefill_tok_ms
    decode_total = new * decode_ms
    total = prefill_ms + decode_total
    weights = int(bench.get("weight_bytes") or 0)
    step_bytes = dec["gbps"] * 1e9 * decode_ms / 1e3 if dec.get("gbps") else None
    return {"model": bench.get("model"), "weight_dtype": bench.get("weight_dtype"),
            "threads": (bench.get("machine") or {}).get("threads"), "prompt_tokens": prompt, "new_tokens": new,
            "measured_prefill_tokens": bench.get("prefill_tokens"),
            "prefill_tokens_per_s": float(pre["tokens_per_s"]), "prefill_ms_per_token": prefill_tok_ms,
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
