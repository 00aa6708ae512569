"""``POST /weight_checker``: vLLM's weight-checker route, contract for contract.

The route is a FastAPI ``APIRouter`` over an engine adapter: an async
callable returning one ``{key: hex}`` dict per worker, and an async callable
that zeroes the weights. Nothing here is specific to one inference engine.
It merges the workers' digests (a key produced twice is an HTTP 500 naming
the duplicates), compares with vLLM's union-and-sorted
semantics, and answers every malformed request with HTTP 400 in vLLM's error
shape ``{"error": {"message", "type", "param", "code"}}``.

    app = FastAPI()
    adapter = EngineAdapter(checksums=..., reset=...)  # one adapter, one lock:
    mount(app, lambda request: adapter)                # resets wait for running checksums

``get_adapter`` must return the same adapter for every request: the adapter
holds the lock that orders a reset after the checksums already running, and
a new adapter per request would have a new lock.

Whether to mount it is the caller's decision (vLLM's glue mounts it only
when ``VLLM_SERVER_DEV_MODE=1``, as vLLM does).
"""

from weight_checker.server.route import EngineAdapter, create_router, mount

__all__ = ["EngineAdapter", "create_router", "mount"]
