"""Schemathesis on the server's own OpenAPI schema: generated requests, valid and invalid
(schemathesis's positive and negative modes), to every operation get no 5xx, and the server still
serves afterwards. Bounded: a few dozen examples per operation, a tiny model, short outputs."""

import pytest

schemathesis = pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

from tests.server.conftest import wait_idle  # noqa: E402

EXAMPLES = 20


def test_no_operation_answers_5xx(live_server):
    raw = httpx.get(live_server.url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(raw)
    operations = [op.ok() for op in schema.get_all_operations()]
    paths = {(op.method.upper(), op.path) for op in operations}
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")} <= paths
    seen = []
    for op in operations:
        if op.path.startswith("/api/"):
            continue  # the explorer's routes: its own tests

        # not derandomized: each run explores afresh (a failure prints its example, and any 5xx is a bug)
        @given(case=st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE)))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case):
            if isinstance(case.body, dict):  # short outputs, few samples: seconds (chat's default: to the end)
                for key, most in (("max_tokens", 2), ("max_completion_tokens", 2), ("n", 2), ("best_of", 2)):
                    value = case.body.get(key)
                    if isinstance(value, int) and not isinstance(value, bool):
                        case.body[key] = min(value, most)  # 0 and negatives stay: they must be 400s
                    elif value is None and "tokens" in key:
                        case.body[key] = most
            response = case.call(base_url=live_server.url, timeout=30)
            seen.append(response.status_code)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text)

        check()
    assert seen and any(400 <= s < 500 for s in seen)
    assert httpx.get(live_server.url + "/health").status_code == 200
    assert wait_idle(live_server.loop)["num_step_failures"] == 0
