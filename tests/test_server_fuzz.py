"""Fuzz POST /weight_checker from its own OpenAPI schema (schemathesis).

Positive cases (bodies the schema allows) must be answered 200; negative
cases (bodies that break the schema) must be 400 in vLLM's error shape: the
schema states exactly what the route accepts. The one exception is this
package's ``block_digests``, whose keys must name tensors the engine holds
(no schema can say which), and whose ``chain`` may name only keys the
request names, each block once (no schema says that either): a schema-valid
one is a 400 naming why (this backend offers no block digests at all, or
the chain is refused first). Nothing may be a 5xx: the one
allowed 500, duplicate keys across workers, cannot happen with this backend.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings

from .test_server import Workers, make_app

app = make_app(Workers())
operation = schemathesis.openapi.from_asgi("/openapi.json", app)["/weight_checker"]["POST"]
fuzz = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


@fuzz
@given(case=operation.as_strategy(schemathesis.GenerationMode.POSITIVE))
def test_valid_bodies_succeed(case):
    response = case.call()
    if case.body.get("action") == "block_digests":
        assert response.status_code == 400, (case.body, response.text)
        error = response.json()["error"]
        assert error["message"] == "this engine cannot give block digests" or error["param"] == "body.chain", error
        return
    assert response.status_code == 200, (case.body, response.text)


@fuzz
@given(case=operation.as_strategy(schemathesis.GenerationMode.NEGATIVE))
def test_invalid_bodies_are_400_in_vllm_shape(case):
    response = case.call()
    assert response.status_code == 400, (case.body, response.text)
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
