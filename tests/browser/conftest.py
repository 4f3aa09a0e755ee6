"""Fixtures of the explorer's browser tests: a live server on loopback and headless Chromium.

Chromium is Debian's package (`apt-get install chromium`; .ci/run installs it), driven by
Playwright through `executable_path` (never `playwright install`: nothing is downloaded). Where
either is missing the tests are skipped with the reason, which `pytest -ra` prints.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
STEP_PACE = 0.005  # seconds the test engine waits after each step (see `live`)
OUT = Path(__file__).resolve().parents[2] / "out" / "explorer"  # gitignored: screenshots of the last run


def missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if CHROMIUM is None:
        return "Chromium not found: browser tests of the explorer skipped (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright not installed: browser tests of the explorer skipped (pip install playwright)"
    for module in ("fastapi", "uvicorn"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} not installed: browser tests of the explorer skipped (pip install 'kvstate[serve]')"
    return None


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """(base URL, app, checkpoint path) of a live explorer."""
    from tests.browser.server import ServerThread, explorer_app, write_checkpoint

    ckpt = write_checkpoint(tmp_path_factory.mktemp("browser-ckpt"))
    app = explorer_app(ckpt)
    with ServerThread(app) as url:
        # The tiny model takes ~1 ms a step on an idle machine: 600 tokens then finish between two of
        # the page's polls (every 400 ms) and no test sees a request run. A real model takes 10-100 ms;
        # pace the engine at one step per STEP_PACE seconds at least (observers run between steps).
        app.state.engine_loop.step_observers.append(lambda core, outs, seconds: time.sleep(STEP_PACE))
        yield url, app, ckpt


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A headless Chromium with a fresh profile."""
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True, args=FLAGS,
                                                   viewport={"width": 1100, "height": 900},
                                                   env={**os.environ, "HOME": str(profile)})
        yield ctx
        ctx.close()


@pytest.fixture
def page(browser, live):
    """The explorer loaded and ready; the test fails on any JavaScript error."""
    pg = browser.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.goto(live[0] + "/")
    pg.wait_for_selector("body[data-ready='1']", timeout=30_000)
    yield pg
    pg.close()
    assert not errors, errors


def keep_screenshot(pg, tmp_path: Path, name: str) -> Path:
    """Full-page screenshot under the test's tmp dir, copied to out/explorer/ for a look afterwards."""
    path = tmp_path / name
    pg.screenshot(path=str(path), full_page=True)
    OUT.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, OUT / name)
    return path
