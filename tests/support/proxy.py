"""A TCP relay on 127.0.0.1 in front of one redis-server, with connection faults to inject.

One thread runs every relayed connection through a selector, so a fault is applied between
two chunks, never in the middle of a socket call. The faults are the ways a connection dies
that a stopped or paused server alone cannot show:

* :meth:`FaultProxy.blackhole` — nothing is relayed either way, connections stay open (a
  half-open connection, a partition); :meth:`heal` relays what was held, as TCP would
  retransmit it once the path is back.
* :meth:`FaultProxy.delay` — every reply is held for a while (a reply slower than the caller's
  deadline).
* :meth:`FaultProxy.reset_mid_reply` — the next reply is cut after its first bytes and both
  sides are reset.
* :meth:`FaultProxy.swallow` — what a client sends next is dropped and its connection closed:
  the server closing a connection just as a command arrives (once, like the cut).
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time
from contextlib import suppress

#: Bytes of a reply relayed before :meth:`FaultProxy.reset_mid_reply` cuts it.
CUT_AFTER = 2


class _Pair:
    """One relayed connection: the client's socket and ours to the server."""

    def __init__(self, down: socket.socket, up: socket.socket) -> None:
        self.down = down
        self.up = up
        self.to_up = bytearray()  # client -> server, held while blackholed
        self.to_down: list[tuple[float, bytes]] = []  # server -> client: (due, data)
        self.closed = False


class FaultProxy:
    """Relays 127.0.0.1:``port`` to 127.0.0.1:``upstream_port``; see the module docstring."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._mode = "pass"
        self._after_cut = "pass"
        self._delay = 0.0
        self._pairs: list[_Pair] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopped = False
        #: Set each time :meth:`swallow` has dropped a command and closed its connection.
        self.swallowed = threading.Event()
        #: Set each time :meth:`reset_mid_reply` has cut a reply.
        self.cut = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fault-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    # -- faults ----------------------------------------------------------------------------

    def _set(self, mode: str, delay: float = 0.0) -> None:
        with self._lock:
            self._mode = mode
            self._delay = delay
        self._wake_w.send(b"x")

    def heal(self) -> None:
        """Relay again, at once, everything held back."""
        self._set("pass")

    def blackhole(self) -> None:
        self._set("blackhole")

    def delay(self, seconds: float) -> None:
        self._set("delay", seconds)

    def reset_mid_reply(self, *, then: str = "pass") -> None:
        """Cut the next reply; then relay again (``then="pass"``), or relay nothing more
        (``then="blackhole"``: the connection made next hears nothing until :meth:`heal`)."""
        self._after_cut = then
        self.cut.clear()
        self._set("cut")

    def swallow(self) -> None:
        self.swallowed.clear()
        self._set("swallow")

    def open_pairs(self) -> list[_Pair]:
        """The relayed connections open now."""
        with self._lock:
            return [pair for pair in self._pairs if not pair.closed]

    def wait_closed(self, pairs: list[_Pair], timeout: float) -> None:
        """Wait until every one of ``pairs`` was closed (by either side); fail after
        ``timeout``."""
        deadline = time.monotonic() + timeout
        while not all(pair.closed for pair in pairs):
            if time.monotonic() > deadline:
                raise AssertionError("relayed connections still open")
            time.sleep(0.01)  # polling the relay thread's state, bounded by the deadline

    def close(self) -> None:
        self._stopped = True
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for pair in self._pairs:
            self._close(pair, reset=False)
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the relay -------------------------------------------------------------------------

    def _loop(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ, "accept")
        selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        while not self._stopped:
            now = time.monotonic()
            dues = [due for pair in self._pairs for due, _ in pair.to_down if not pair.closed]
            timeout = 0.05 if not dues else max(0.0, min(min(dues) - now, 0.05))
            for key, _ in selector.select(timeout):
                if key.data == "accept":
                    self._accept(selector)
                elif key.data == "wake":
                    self._wake_r.recv(4096)
                else:
                    pair, side = key.data
                    if not pair.closed:
                        self._receive(selector, pair, side)
            self._flush(selector)

    def _accept(self, selector: selectors.BaseSelector) -> None:
        try:
            down, _ = self._listener.accept()
        except OSError:
            return
        try:
            up = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
        except OSError:
            down.close()
            return
        down.setblocking(True)
        up.setblocking(True)
        pair = _Pair(down, up)
        with self._lock:
            self._pairs.append(pair)
        selector.register(down, selectors.EVENT_READ, (pair, "down"))
        selector.register(up, selectors.EVENT_READ, (pair, "up"))

    def _mode_now(self) -> tuple[str, float]:
        """The fault in force now: read for each chunk, never before a wait, so a fault set
        while the relay waits applies to the very next chunk."""
        with self._lock:
            return self._mode, self._delay

    def _receive(self, selector: selectors.BaseSelector, pair: _Pair, side: str) -> None:
        sock = pair.down if side == "down" else pair.up
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        if not data:  # one side closed: close the other
            self._drop(selector, pair, reset=False)
            return
        mode, delay = self._mode_now()
        if side == "down":
            if mode == "swallow":  # one connection only, like "cut"
                self._drop(selector, pair, reset=False)
                with self._lock:
                    self._mode = "pass"
                self.swallowed.set()
                return
            pair.to_up += data
            return
        if mode == "cut":
            with suppress(OSError):
                pair.down.sendall(data[:CUT_AFTER])
            self._drop(selector, pair, reset=True)
            with self._lock:
                self._mode = self._after_cut
            self.cut.set()
            return
        pair.to_down.append((time.monotonic() + (delay if mode == "delay" else 0.0), data))

    def _flush(self, selector: selectors.BaseSelector) -> None:
        if self._mode_now()[0] == "blackhole":
            return
        now = time.monotonic()
        for pair in list(self._pairs):
            if pair.closed:
                continue
            try:
                if pair.to_up:
                    pair.up.sendall(bytes(pair.to_up))
                    pair.to_up.clear()
                while pair.to_down and pair.to_down[0][0] <= now:
                    pair.down.sendall(pair.to_down.pop(0)[1])
            except OSError:
                self._drop(selector, pair, reset=False)

    def _drop(self, selector: selectors.BaseSelector, pair: _Pair, *, reset: bool) -> None:
        for sock in (pair.down, pair.up):
            with suppress(KeyError, ValueError):
                selector.unregister(sock)
        self._close(pair, reset=reset)

    @staticmethod
    def _close(pair: _Pair, *, reset: bool) -> None:
        if pair.closed:
            return
        pair.closed = True
        for sock in (pair.down, pair.up):
            if reset:  # SO_LINGER 0: close() sends RST, not FIN
                with suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
