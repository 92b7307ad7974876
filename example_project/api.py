"""A stand-in for a third-party API that is rate-limited per entity.

The demo runs :class:`ExternalAPI` in a background thread of its controller process; Celery
workers call it over HTTP on 127.0.0.1. Besides rate limiting, it counts what a real provider
would bill or ban you for: calls for the same entity that overlap. Those are what a per-entity
lock is meant to prevent, so the demo reads them back from :meth:`ExternalAPI.stats`.

    with ExternalAPI(rate=5.0) as api:
        status, body = call(api.url, "crm", "customer-1", caller="worker-1")
        print(status, body, api.stats())
"""

from __future__ import annotations

import functools
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

__all__ = ["ExternalAPI", "call"]

Entity = tuple[str, str]  # (source, entity)


@dataclass
class _Bucket:
    """Token bucket: ``tokens`` refill at ``rate`` per second up to ``burst``."""

    tokens: float
    refilled_at: float


@dataclass
class _EntityStats:
    calls: int = 0
    max_concurrent: int = 0
    duplicate_calls: int = 0
    rate_limited: int = 0


class ExternalAPI:
    """HTTP server rate-limited per (source, entity) that records overlapping calls.

    ``rate`` tokens per second refill each entity's bucket, which holds at most ``burst``; a
    call without a token gets 429 at once. A served call takes ``latency`` seconds, the
    simulated work during which a second call for the same entity counts as a duplicate.
    """

    def __init__(self, rate: float = 5.0, burst: int = 1, latency: float = 0.15) -> None:
        if rate <= 0 or burst < 1 or latency < 0:
            raise ValueError(
                f"ExternalAPI(rate={rate!r}, burst={burst!r}, latency={latency!r}): "
                "need rate > 0, burst >= 1 and latency >= 0"
            )
        self.rate = rate
        self.burst = burst
        self.latency = latency
        self._lock = threading.Lock()
        self._buckets: dict[Entity, _Bucket] = {}
        self._stats: dict[Entity, _EntityStats] = {}
        # Kept apart from _stats so that reset() during a call cannot unbalance it.
        self._in_flight: dict[Entity, int] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> ExternalAPI:
        """Listen on a free port of 127.0.0.1 and serve from a daemon thread; returns self."""
        if self._server is not None:
            raise RuntimeError("ExternalAPI.start(): already started; call stop() first")
        server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, api=self))
        server.daemon_threads = True  # a hung client must not keep the process alive
        # Many workers may connect at the same moment; the default backlog of 5 is small.
        server.request_queue_size = 128
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            # How often serve_forever checks for shutdown: keeps stop() quick.
            kwargs={"poll_interval": 0.05},
            name="external-api",
            daemon=True,
        )
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:54321``."""
        if self._server is None:
            raise RuntimeError("ExternalAPI.url: not started; call start() first")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def stop(self) -> None:
        """Stop serving and close the socket. Safe to call twice."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join()

    def __enter__(self) -> ExternalAPI:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- statistics --------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget all counts and refill every bucket, so that the next demo pass starts clean."""
        with self._lock:
            self._stats.clear()
            self._buckets.clear()

    def stats(self) -> dict[str, Any]:
        """Counts per ``"source:entity"`` and totals, as ``GET /stats`` returns them."""
        with self._lock:
            entities = {
                f"{source}:{entity}": {
                    "calls": s.calls,
                    "max_concurrent": s.max_concurrent,
                    "duplicate_calls": s.duplicate_calls,
                    "rate_limited": s.rate_limited,
                }
                for (source, entity), s in sorted(self._stats.items())
            }
        values = entities.values()
        return {
            "entities": entities,
            "calls": sum(e["calls"] for e in values),
            "rate_limited": sum(e["rate_limited"] for e in values),
            "max_concurrent": max((e["max_concurrent"] for e in values), default=0),
            "duplicate_calls": sum(e["duplicate_calls"] for e in values),
        }

    # -- the endpoint ------------------------------------------------------------------------

    def collect(self, source: str, entity: str) -> tuple[int, dict[str, Any]]:
        """Serve one ``/collect`` call: (HTTP status, JSON body). Blocks for ``latency``."""
        key = (source, entity)
        with self._lock:
            stats = self._stats.setdefault(key, _EntityStats())
            wait = self._take_token(key)
            if wait > 0:
                stats.rate_limited += 1
                return HTTPStatus.TOO_MANY_REQUESTS, {
                    "error": "rate limited",
                    "retry_after": round(wait, 3),
                }
            stats.calls += 1
            running = self._in_flight.get(key, 0) + 1
            self._in_flight[key] = running
            if running > 1:
                stats.duplicate_calls += 1
            stats.max_concurrent = max(stats.max_concurrent, running)
        try:
            time.sleep(self.latency)
        finally:
            with self._lock:
                self._in_flight[key] -= 1
        return HTTPStatus.OK, {
            "source": source,
            "entity": entity,
            # Stable across processes and runs, unlike hash().
            "items": zlib.crc32(f"{source}:{entity}".encode()) % 1000,
            "served_at": time.time(),
        }

    def _take_token(self, key: Entity) -> float:
        """Take a token from ``key``'s bucket: 0.0 if taken, else seconds until one is due."""
        now = time.monotonic()
        bucket = self._buckets.setdefault(key, _Bucket(tokens=float(self.burst), refilled_at=now))
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.refilled_at) * self.rate)
        bucket.refilled_at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate


class _Handler(BaseHTTPRequestHandler):
    """Routes requests to an :class:`ExternalAPI`; every answer is JSON."""

    def __init__(self, *args: Any, api: ExternalAPI) -> None:
        self.api = api  # set first: the base class handles the request inside __init__
        super().__init__(*args)

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/stats":
            self._send(HTTPStatus.OK, self.api.stats())
        elif url.path == "/collect":
            query = urllib.parse.parse_qs(url.query)
            missing = [name for name in ("source", "entity", "caller") if not query.get(name)]
            if missing:
                self._send(
                    HTTPStatus.BAD_REQUEST, {"error": f"missing query parameter(s): {missing}"}
                )
                return
            # The caller is accepted for the server's logs in real life; it changes nothing here.
            self._send(*self.api.collect(query["source"][0], query["entity"][0]))
        else:
            self._not_found()

    def do_POST(self) -> None:
        if urllib.parse.urlsplit(self.path).path == "/reset":
            self.api.reset()
            self._send(HTTPStatus.OK, {"reset": True})
        else:
            self._not_found()

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: the demo prints its own narrative."""

    def _not_found(self) -> None:
        self._send(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: {self.command} {self.path}"})

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def call(
    api_url: str, source: str, entity: str, caller: str, timeout: float = 5.0
) -> tuple[int, dict[str, Any]]:
    """``GET /collect`` on ``api_url``: (HTTP status, JSON body).

    HTTP error statuses such as 429 are returned, not raised, so callers can read
    ``retry_after``; network errors (refused, timed out) still raise.
    """
    query = urllib.parse.urlencode({"source": source, "entity": entity, "caller": caller})
    try:
        with urllib.request.urlopen(f"{api_url}/collect?{query}", timeout=timeout) as response:
            status: int = response.status
            body: dict[str, Any] = json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:  # closes the response it wraps
            status, body = error.code, json.loads(error.read())
    return status, body
