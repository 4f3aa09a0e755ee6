"""The explorer on a server with an API key: the page takes the key from ?key=... (kept in
localStorage, dropped from the address bar) or asks for it after a 401, and then works as without
a key (models, the memory panel, the served model's name)."""

from __future__ import annotations

import pytest

from tests.browser.conftest import missing

if (why := missing()) is not None:
    pytest.skip(why, allow_module_level=True)

KEY = "browser-test-key"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    from kvstate import LLM
    from kvstate.server import explorer
    from kvstate.server.app import create_app
    from tests.browser.server import MODEL_NAME, ServerThread, write_checkpoint

    ckpt = write_checkpoint(tmp_path_factory.mktemp("keyed-ckpt"))
    llm = LLM(ckpt, cache_memory="8MiB", max_model_len=256, max_num_seqs=2)
    app = create_app(llm, model_name=MODEL_NAME, routers=[explorer.router], api_key=KEY)
    with ServerThread(app) as url:
        yield url


def _ready(pg) -> str:
    pg.wait_for_selector("body[data-ready='1']", timeout=30_000)
    return pg.inner_text("#served")


def test_the_page_takes_the_key_from_the_address_or_asks_once(browser, keyed):
    pg = browser.new_page()  # the module's fresh profile, the keyed server's own origin: no key stored yet
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    asked: list[str] = []
    # The handler is in place before the first load: a reload after clearing the key raced the first
    # load's own 401 prompt (auto-dismissed, or answered on a page being replaced) and hung under load.
    pg.on("dialog", lambda d: (asked.append(d.message), d.accept(KEY)))
    pg.goto(keyed + "/")
    assert "serving" in _ready(pg) and len(asked) == 1  # one 401 asked; the key then served every call
    assert pg.evaluate("localStorage.getItem('kvstate-api-key')") == KEY
    assert pg.evaluate("fetch('explorer/api/models').then(r => r.status)") == 401  # the key is needed

    pg.evaluate("localStorage.removeItem('kvstate-api-key')")
    pg.goto(keyed + f"/?key={KEY}")
    assert "serving" in _ready(pg) and len(asked) == 1  # from the address: not asked again
    assert "key=" not in pg.url and pg.evaluate("localStorage.getItem('kvstate-api-key')") == KEY
    pg.evaluate("localStorage.removeItem('kvstate-api-key')")
    pg.close()
    assert not errors, errors
