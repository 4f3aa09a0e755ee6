"""The test run's line about the compiled kernels: loaded or not (and why), and which ISA paths ran.

Each process (an xdist worker, or the single pytest process) reports the extension's call counters
(`paths_run()`); the controller adds them up and prints one line in the terminal summary, so a run
that silently took the torch fallback, or never reached an ISA path, says so.
"""

from __future__ import annotations

from kvstate.kernels import _ext, build


def snapshot() -> dict:
    """This process's state: {"loaded": bool|None, "reason", "isas", "cap", "paths": {path: calls}}."""
    seen = _ext.peek()
    if seen is None:
        return {"loaded": None, "reason": "no test of this process used them", "isas": [], "cap": None, "paths": {}}
    module, reason = seen
    if module is None:
        return {"loaded": False, "reason": reason, "isas": [], "cap": None, "paths": {}}
    return {"loaded": True, "reason": None, "isas": list(module.isas()), "cap": module.isa_cap(),
            "paths": dict(module.paths_run())}


def merge(snaps: list[dict]) -> dict:
    used = [s for s in snaps if s["loaded"] is not None] or snaps or [snapshot()]
    out = dict(used[0], paths={})
    out["loaded"] = None if all(s["loaded"] is None for s in used) else all(s["loaded"] is not False for s in used)
    for s in used:
        if s["loaded"] is False:
            out["reason"] = s["reason"]
        out["isas"] = out["isas"] or s["isas"]
        out["cap"] = out["cap"] or s["cap"]
        for path, n in s["paths"].items():
            out["paths"][path] = out["paths"].get(path, 0) + n
    return out


def line(state: dict) -> str:
    if state["loaded"] is None:
        return "kvstate kernels: not used by this run"
    if not state["loaded"]:
        outcome = "failed (required here)" if build.required() else "were skipped"
        return f"kvstate kernels: NOT loaded ({state['reason']}); the kernel tests {outcome}"
    ran = [f"{p} x{n}" for p, n in sorted(state["paths"].items()) if n]
    here = [p for p, n in sorted(state["paths"].items()) if not n and p.split()[-1] in state["isas"]]
    cap = "" if state["cap"] in (None, "auto") else f", capped at {state['cap']}"
    return (f"kvstate kernels: loaded (CPU: {', '.join(state['isas'])}{cap}); paths run: {', '.join(ran) or 'none'}"
            + (f"; not run though this CPU has them: {', '.join(here)}" if here else ""))


