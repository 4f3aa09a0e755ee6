"""KVSTATE_KERNELS=avx2 (or avx512) caps every kernel path at that ISA: the linear kernels called with
"auto" (as the compiled decode blocks call them), the gated delta rule's per-head kernel, and info();
and the extension counts the calls of each path (the test run's summary prints them)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstate.kernels import _ext
from tests.kernels.conftest import extension
from tests.kernel_paths import line, merge

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def capped():
    """The extension with its cap restored (and the per-head kernel's form) after the test."""
    ext = extension()
    cap, head = ext.isa_cap(), ext.gdn_head_isa()
    yield ext
    ext.set_isa_cap(cap)
    ext.set_gdn_head_isa(head)


def _runs(ext, fn) -> dict:
    before = dict(ext.paths_run())
    fn()
    return {k: v - before.get(k, 0) for k, v in ext.paths_run().items() if v - before.get(k, 0)}


def test_the_avx2_cap_sends_auto_calls_and_the_delta_rule_to_avx2(capped):
    ext = capped
    ext.set_isa_cap("avx2")
    assert ext.isa_cap() == "avx2" and ext.gdn_head_isa() == "avx2"
    x, w = torch.randn(3, 37), torch.randn(19, 37).bfloat16()
    ran = _runs(ext, lambda: ext.linear(x, w, None, "auto"))
    assert ran == {"linear avx2": 1}
    torch.testing.assert_close(ext.linear(x, w, None, "auto"), x @ w.float().T, rtol=1e-5, atol=1e-5)
    ext.set_isa_cap("auto")
    best = ext.isas()[0]
    assert _runs(ext, lambda: ext.linear(x, w, None, "auto")) == {f"linear {best}": 1}
    assert ext.gdn_head_isa() == ("avx512" if "avx512" in ext.isas() else "avx2")


def test_the_delta_rule_counts_its_calls_per_form(capped):
    ext = capped
    ext.set_isa_cap("avx2")
    n, H, K = 2, 2, 16
    q, k, v = torch.randn(n, H, K), torch.randn(n, H, K), torch.randn(n, H, K)
    g, beta = -torch.rand(n, H), torch.rand(n, H)
    pool = torch.zeros(4, H, K, K)
    ran = _runs(ext, lambda: ext.gdn_recurrent(q, k, v, g, beta, pool, torch.tensor([0, 2]), K ** -0.5))
    assert ran == {"gdn head avx2": 1}


def test_an_unknown_cap_is_refused(capped):
    with pytest.raises(RuntimeError, match="ISA cap auto, amx, avx512 or avx2"):
        capped.set_isa_cap("sse2")


def test_the_environment_variable_sets_the_cap_at_load(tmp_path):
    extension()  # built in the default cache, which the child shares
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVSTATE_KERNELS": "avx2",
           "KVSTATE_KERNELS_CACHE": str(_ext.cache_root())}
    code = ("from kvstate.kernels import _ext, info; e = _ext.load(); "
            "print(e.isa_cap(), e.gdn_head_isa(), info()['isa'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["avx2", "avx2", "avx2"]


def test_the_summary_line_says_what_ran_and_what_did_not():
    a = {"loaded": True, "reason": None, "isas": ["avx512", "avx2"], "cap": "auto",
         "paths": {"linear avx2": 5, "linear avx512": 0, "linear amx": 0, "gdn head avx2": 2}}
    b = {"loaded": None, "reason": "unused", "isas": [], "cap": None, "paths": {}}
    text = line(merge([a, dict(a, paths={"linear avx2": 1}), b]))
    assert text == ("kvstate kernels: loaded (CPU: avx512, avx2); paths run: gdn head avx2 x2, linear avx2 x6; "
                    "not run though this CPU has them: linear avx512")
    missing = {"loaded": False, "reason": "no C++ compiler found", "isas": [], "cap": None, "paths": {}}
    assert "NOT loaded (no C++ compiler found)" in line(merge([a, missing]))
    assert line(merge([b])) == "kvstate kernels: not used by this run"
