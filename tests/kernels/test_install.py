"""Every install gets the kernels: the sources ship in the wheel, build once into the per-user cache
(keyed by sources, torch and flags), and a build that cannot run is one line and the torch fallback;
where the kernels are required (CI) a missing extension is an error."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from kvstate.kernels import _compile, _ext, build
from tests.kernels.conftest import extension

ROOT = Path(__file__).resolve().parents[2]


def _child(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    """`python -c code` in a fresh process with a cache of its own (and env's variables)."""
    full = {**os.environ, "KVSTATE_KERNELS_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT), **env}
    for name in ("CI", "KVSTATE_REQUIRE_KERNELS", "KVSTATE_KERNELS"):
        if name not in env:
            full.pop(name, None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)


def test_the_build_key_follows_the_sources(tmp_path, monkeypatch):
    key = _ext.build_key()
    assert len(key) == 16 and _ext.build_dir().name == key
    copy = tmp_path / "csrc"
    copy.mkdir()
    for p in _ext.sources():
        copy.joinpath(p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(_compile, "CSRC", copy)  # where the build reads its sources
    assert _ext.build_key() == key  # the same bytes: the same build, wherever they are installed
    (copy / "gemv.cpp").write_text((copy / "gemv.cpp").read_text() + "\n// edited\n")
    assert _ext.build_key() != key  # an edited kernel never loads an older build


def test_without_a_compiler_it_is_one_line_and_the_torch_fallback(tmp_path):
    code = ("from kvstate.kernels import info, linear; import torch; "
            "y = linear(torch.ones(1, 8), torch.ones(4, 8)); print(info()['backend'], float(y.sum()))")
    done = _child(code, tmp_path, PATH=str(tmp_path))  # no c++ on this PATH
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["torch", "32.0"]
    assert done.stderr.strip().splitlines() == [
        "kvstate kernels: no C++ compiler found (install g++ to get the compiled kernels); the torch fallback runs"]
    # the build command says the same in one line, and fails only where the kernels are required
    cmd = "from kvstate.kernels.build import main; raise SystemExit(main([]))"
    done = _child(cmd, tmp_path, PATH=str(tmp_path))
    assert done.returncode == 0 and "no C++ compiler found" in done.stdout and "fallback" in done.stdout
    done = _child(cmd, tmp_path, PATH=str(tmp_path), CI="true")
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1 and "required here" in done.stderr


def test_a_failed_compile_is_one_line_and_not_retried_by_each_process(tmp_path):
    broken = tmp_path / "csrc"
    broken.mkdir()
    (broken / "broken.cpp").write_text('#error "kvstate test: this does not compile"\n')
    code = ("from kvstate.kernels import _compile, _ext; from pathlib import Path; _compile.CSRC = Path(%r); "
            "print(_ext.load() is None, '|', _ext.unavailable_reason())") % str(broken)
    first = _child(code, tmp_path)
    assert first.stdout.startswith("True |") and "build failed" in first.stdout, first.stderr
    lines = first.stderr.strip().splitlines()
    assert len(lines) == 1 and "compiling for this CPU" in lines[0] and "failed" in lines[0]
    again = _child(code, tmp_path)  # the failure is remembered: no second compile, no output
    assert again.stderr == "" and "to retry" in again.stdout


@pytest.mark.parametrize("env, required", [({}, False), ({"CI": "true"}, True), ({"CI": "false"}, False),
                                           ({"KVSTATE_REQUIRE_KERNELS": "1"}, True),
                                           ({"CI": "true", "KVSTATE_REQUIRE_KERNELS": "0"}, False)])
def test_kernels_are_required_under_ci_or_when_asked(monkeypatch, env, required):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("KVSTATE_REQUIRE_KERNELS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert build.required() is required


@pytest.mark.slow
def test_a_wheel_in_a_fresh_venv_loads_the_kernels(tmp_path):
    """`pip wheel .` then that wheel in a fresh venv: the sources are in it and the kernels load (from
    the cache this run already built: the key of the installed sources is the tree's)."""
    extension()  # the tree's build, in the default cache (compiled once if missing)
    source = tmp_path / "src"  # a copy: setuptools leaves build/ and *.egg-info where it builds
    skip = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__", "_build", "docs", "tests")
    shutil.copytree(ROOT, source, ignore=skip)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(source)],
                   check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("kvstate-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"kvstate/kernels/csrc/{p.name}" for p in _ext.sources()} <= set(names)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # torch and the other dependencies from this environment (appended after the venv's own packages)
    site.joinpath("deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                    "--disable-pip-version-check", str(wheel)], check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVSTATE_KERNELS_CACHE")}
    env["KVSTATE_KERNELS_CACHE"] = str(_ext.cache_root())
    done = subprocess.run([str(py), "-c", "import json, kvstate, kvstate.kernels as k; "
                           "print(json.dumps(dict(k.info(), file=kvstate.__file__)))"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["file"].startswith(str(site)), info  # the installed copy, not this tree
    assert info["backend"] == "extension" and info["library"] == str(_ext.library()), info
    done = subprocess.run([str(py), "-m", "kvstate.kernels.build"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0 and "up to date" in done.stdout, done.stdout + done.stderr
