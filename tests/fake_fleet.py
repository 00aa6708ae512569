"""Local fake API servers for fleet tests: vLLM's dev-mode control routes with
a checksum that takes a set time (or hangs, boundedly), on 127.0.0.1 only.

Each server serves ``dp{rank}:pp0:pcp0:tp{t}:w{j}`` keys (``tp`` ranks, three
tensors each); ``independent=True`` makes every server serve ``dp0`` (a fleet
of replicas). ``weights`` and ``loaded`` are keyed by the full key."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: A hung request ends by itself after this (or when its fleet stops). The
#: tests' timeouts are far below it, and a run that did not time out takes at
#: least this long, so "elapsed < HANG_S" tells the two apart on any load.
HANG_S = 60.0


class InFlight:
    """Requests in flight across a fleet, and the most seen at once: what
    proves the client asked servers concurrently (or boundedly), whatever
    the machine's load, where a wall-clock bound would depend on it.

    ``meet``: a request waits (at most ``patience`` s) until that many are
    in flight at once, so that a client asking concurrently always reaches
    it, and one asking one server after another never does."""

    def __init__(self, meet: int = 0, patience: float = 60.0, only: str | None = None):
        #: ``"checksum"`` or ``"reload"``: count only those requests.
        self.meet, self.patience, self.only = meet, patience, only
        self.now = self.peak = 0
        self.cond = threading.Condition()

    @contextlib.contextmanager
    def request(self, kind: str) -> Iterator[None]:
        if self.only not in (None, kind):
            yield
            return
        with self.cond:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.peak >= self.meet, timeout=self.patience)
        try:
            yield
        finally:
            with self.cond:
                self.now -= 1


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        # A client that gave up (its timeout) leaves a broken pipe behind: not
        # worth a traceback on the test process's stderr, which other tests read.
        pass


#: A MoE layer's expert parameters, as vLLM names them.
EXPERTS = ("layers.0.experts.w13_weight", "layers.0.experts.w2_weight")


class FakeServer:
    def __init__(
        self,
        rank: int,
        *,
        delay: float = 0.0,
        hang: bool = False,
        fail_pause: bool = False,
        tp: int = 1,
        moe_dp: int = 0,
        says_sharded: bool = True,
        unseen: tuple[str, ...] = (),
    ):
        self.rank = rank
        #: Parameters whose weights it holds outside its parameters: each
        #: checksum answers an ``unseen:`` key for them with a fresh random digest.
        self.unseen = unseen
        self.delay = delay
        self.hang = hang
        self.fail_pause = fail_pause
        self.paused = False
        self.loaded = {
            f"dp{rank}:pp0:pcp0:tp{t}:w{j}": hashlib.sha256(f"{rank}-{t}-{j}".encode()).hexdigest()
            for t in range(tp)
            for j in range(3)
        }
        #: ``moe_dp=N``: one MoE engine of N DP ranks: the same dense weights on
        #: each, and each DP rank's own part of the experts.
        self.moe_dp = moe_dp
        #: Whether it answers ``weight_checker_dp_sharded`` (this package's plugin).
        self.says_sharded = says_sharded
        if moe_dp:
            self.loaded = {
                f"dp{d}:pp0:pcp0:tp{t}:{name}": hashlib.sha256(
                    f"{t}-{name}-{d if name in EXPERTS else 0}".encode()
                ).hexdigest()
                for d in range(moe_dp)
                for t in range(tp)
                for name in ("w0", "w1", *EXPERTS)
            }
        self.weights = dict(self.loaded)
        #: How many resets this server received.
        self.resets = 0
        #: Seconds a reload_weights takes.
        self.reload_delay = 0.0
        #: Seconds a pause takes to answer, after it paused.
        self.pause_delay = 0.0
        #: Where checksums and reloads count themselves in flight (shared by a fleet).
        self.in_flight: InFlight | None = None
        #: Set when the fleet stops: a hung request then ends at once.
        self.stopping = threading.Event()
        self.httpd = _QuietServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/is_paused":
                    return self.reply(200, {"is_paused": server.paused})
                if self.path == "/version":
                    return self.reply(200, {"version": "0.32.0"})
                return self.reply(404, {"detail": "not found"})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                if self.path.startswith("/pause"):
                    if server.fail_pause:
                        return self.reply(500, {"detail": "cannot pause"})
                    server.paused = True
                    server.stopping.wait(server.pause_delay)
                    return self.reply(200, {"status": "paused"})
                if self.path == "/resume":
                    server.paused = False
                    return self.reply(200, {"status": "resumed"})
                if self.path == "/collective_rpc" and body.get("method") == "weight_checker_dp_sharded":
                    if not server.says_sharded:
                        return self.reply(500, {"error": {"message": "no such method", "code": 500}})
                    return self.reply(200, {"results": [list(EXPERTS) if server.moe_dp > 1 else []]})

                def counted(kind: str):
                    return server.in_flight.request(kind) if server.in_flight else contextlib.nullcontext()

                if self.path == "/collective_rpc" and body.get("method") == "reload_weights":
                    with counted("reload"):
                        time.sleep(server.reload_delay)
                        server.weights = dict(server.loaded)
                    return self.reply(200, {"results": [None]})
                if self.path == "/weight_checker" and body.get("action") == "checksum":
                    with counted("checksum"):
                        if server.hang:
                            server.stopping.wait(HANG_S)
                        time.sleep(server.delay)
                    scope = {"include": body["include"]} if "include" in body else {}  # as this package's route
                    unseen = {f"dp{server.rank}:pp0:pcp0:tp0:unseen:{n}": os.urandom(32).hex() for n in server.unseen}
                    return self.reply(200, {"checksums": dict(server.weights) | unseen, **scope})
                if self.path == "/weight_checker" and body.get("action") == "reset":
                    server.resets += 1
                    server.weights = {k: hashlib.sha256(b"\0").hexdigest() for k in server.weights}
                    return self.reply(200, {"status": "reset"})
                return self.reply(400, {"detail": "bad request"})

        return Handler


@contextlib.contextmanager
def fake_fleet(
    n: int, *, independent: bool = False, tp: int = 1, in_flight: InFlight | None = None, **special: dict
) -> Iterator[list[FakeServer]]:
    """``n`` fake servers, started and stopped together; ``special`` maps a
    server index (as a string) to its options, e.g. ``{"3": {"hang": True}}``;
    ``in_flight`` counts their checksums and reloads in flight."""
    servers = []
    for i in range(n):
        options = {"tp": tp, **special.get(str(i), {})}
        s = FakeServer(0 if independent else i, **options)
        s.in_flight = in_flight
        servers.append(s)
    threads = [threading.Thread(target=s.httpd.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    try:
        yield servers
    finally:
        for s in servers:
            s.stopping.set()
            s.httpd.shutdown()
            s.httpd.server_close()


def reload_all(servers: list[FakeServer]):
    def transfer() -> None:
        for s in servers:
            s.weights = dict(s.loaded)

    return transfer
