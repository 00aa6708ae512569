"""The weight-update routes' error paths, over stand-in originals (what the
real vLLM server does on the happy paths is tests/test_weight_transfer.py's):
an update is committed and its version set whatever its digests do, and a
finish the workers cannot run is vLLM's own."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from weight_checker.server.weight_update import (
    FINISH,
    UPDATE,
    WeightUpdateRoutes,
    create_weight_update_router,
    original_routes,
)


class Engine:
    """What the routes reach: vLLM's own routes (recording what they got) and
    the workers' finish-and-hash (answers or a failure given by the test)."""

    def __init__(self, answers: Any, begin_fails: bool = False):
        self.answers = answers
        self.calls: list[tuple[str, Any]] = []
        app = FastAPI()

        @app.post(UPDATE)
        async def update(body: dict) -> dict:
            self.calls.append(("vllm update", body))
            return {"message": "Weights updated"}

        @app.post(FINISH)
        async def finish(body: dict | None = None) -> dict:
            self.calls.append(("vllm finish", body))
            return {"message": "Weight update finished"}

        originals = original_routes(app)
        app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in (UPDATE, FINISH)]

        async def finish_and_hash(include: list[str] | None) -> list[dict[str, Any]]:
            self.calls.append(("finish and hash", include))
            if isinstance(self.answers, Exception):
                raise self.answers
            return self.answers

        async def set_weight_version(version: str) -> None:
            self.calls.append(("version", version))

        async def begin_digests() -> None:
            self.calls.append(("begin", None))
            if begin_fails:
                raise RuntimeError("'CPUWorker' object has no attribute 'weight_checker_begin_update_digests'")

        async def end_digests() -> None:
            self.calls.append(("end", None))

        self.routes = WeightUpdateRoutes(
            originals, finish_and_hash, set_weight_version, begin_digests=begin_digests, end_digests=end_digests
        )
        app.include_router(create_weight_update_router(lambda request: self.routes))
        self.http = TestClient(app)


def update_then_finish(engine: Engine, version: str = "v1") -> Any:
    assert engine.http.post(UPDATE, json={"update_info": {}, "checksum": True}).status_code == 200
    return engine.http.post(FINISH, json={"weight_version": version})


def test_digests_that_fail_after_the_commit_are_reported_and_the_version_is_set():
    engine = Engine([{"checksums": {"dp0:pp0:pcp0:tp0:w": "0" * 64}}, {"error": "MemoryError: pinned", "rank": "x"}])
    answer = update_then_finish(engine)
    assert answer.status_code == 200
    body = answer.json()
    assert "checksums" not in body and "MemoryError" in body["checksum_error"]
    assert ("version", "v1") in engine.calls


def test_duplicate_keys_are_reported_and_the_version_is_set():
    same = {"checksums": {"dp0:pp0:pcp0:tp0:w": "0" * 64}}
    answer = update_then_finish(Engine([same, same]))
    assert answer.status_code == 200 and "Duplicate" in answer.json()["checksum_error"]


def test_a_finish_the_workers_cannot_run_is_vllms_own():
    engine = Engine(AttributeError("'CPUWorker' object has no attribute 'weight_checker_finish_weight_update'"))
    answer = update_then_finish(engine)
    assert answer.status_code == 200 and answer.json() == {"message": "Weight update finished"}
    assert engine.calls[-1] == ("vllm finish", {"weight_version": "v1"})


@pytest.mark.parametrize("then_plain", [True, False])
def test_an_update_without_the_flag_drops_an_abandoned_session(then_plain):
    engine = Engine([{"checksums": {"dp0:pp0:pcp0:tp0:w": "0" * 64}}])
    assert engine.http.post(UPDATE, json={"update_info": {}, "checksum": True}).status_code == 200
    if then_plain:  # the flagged update abandoned; a plain one follows
        assert engine.http.post(UPDATE, json={"update_info": {}}).status_code == 200
    body = engine.http.post(FINISH, json={"weight_version": "v2"}).json()
    assert ("checksums" in body) is not then_plain


def test_a_finish_that_fails_otherwise_is_an_error_naming_it_not_vllms_finish_again():
    """Some workers may have committed: vLLM's own finish would fail with a
    misleading "no matching start"; the real error is answered instead."""
    engine = Engine(RuntimeError("engine 1 died"))
    answer = update_then_finish(engine)
    assert answer.status_code == 500 and "engine 1 died" in answer.json()["error"]["message"]
    assert not any(call[0] == "vllm finish" for call in engine.calls)


def test_an_update_that_does_not_ask_for_digests_gets_vllms_own_finish():
    engine = Engine([{"checksums": {"dp0:pp0:pcp0:tp0:w": "0" * 64}}])
    assert engine.http.post(UPDATE, json={"update_info": {}, "checksum": True}).status_code == 200
    assert engine.http.post(UPDATE, json={"update_info": {}, "checksum": False}).status_code == 200
    assert engine.http.post(FINISH, json={"weight_version": "v3"}).json() == {"message": "Weight update finished"}


def test_workers_hash_as_layers_commit_from_the_flagged_update_and_drop_it_without_the_flag():
    """A flagged update asks every worker to hash each layer as it commits
    (before vLLM's update runs); an update or a finish without the flag after
    such a session asks them to drop it; nothing is asked where no session
    was begun (the routes stay vLLM's own)."""
    engine = Engine([{"checksums": {"dp0:pp0:pcp0:tp0:w": "0" * 64}}])
    update_then_finish(engine)
    names = [c[0] for c in engine.calls]
    assert names[:2] == ["begin", "vllm update"] and "end" not in names
    engine.calls.clear()
    assert engine.http.post(UPDATE, json={"update_info": {}}).status_code == 200
    assert engine.http.post(FINISH, json={}).status_code == 200
    assert [c[0] for c in engine.calls] == ["vllm update", "vllm finish"]  # no session: nothing to drop
    engine.calls.clear()
    assert engine.http.post(UPDATE, json={"update_info": {}, "checksum": True}).status_code == 200
    assert engine.http.post(UPDATE, json={"update_info": {}}).status_code == 200
    assert [c[0] for c in engine.calls] == ["begin", "vllm update", "end", "vllm update"]


def test_workers_that_cannot_hash_as_layers_commit_still_give_digests_at_the_finish():
    engine = Engine([{"checksums": {"dp0:pp0:pcp0:tp0:w": "0" * 64}}], begin_fails=True)
    answer = update_then_finish(engine)
    assert answer.status_code == 200 and answer.json()["checksums"] == {"dp0:pp0:pcp0:tp0:w": "0" * 64}
    assert "end" not in [c[0] for c in engine.calls]
