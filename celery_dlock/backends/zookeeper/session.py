"""One kazoo client per process and ZooKeeper URL, shared by every lease; its session's
states mapped onto the leases it holds.

A lock node is *ephemeral*: it lives exactly as long as the session that created it
(https://zookeeper.apache.org/doc/current/zookeeperProgrammers.html#Ephemeral+Nodes). So a
lease is exactly as good as its session, and kazoo's three states say how good that is
(https://kazoo.readthedocs.io/en/latest/basic_usage.html#understanding-kazoo-states):

* ``CONNECTED`` — the session is live. A lease is valid until the session timeout after the
  last request of ours the servers answered (counted from when it was sent), minus the drift
  allowance; the watchdog sends one such request per session (an ``exists`` on the base node,
  whatever the number of leases: it proves every node of the session) every
  third of the timeout (:class:`celery_dlock.backends.zookeeper.lease.ZkLease`).
* ``SUSPENDED`` — the connection is gone and the session may or may not still be alive on the
  servers. kazoo declares this when a heartbeat ping has gone unanswered (it pings after a third
  of the session timeout without traffic, and gives up on the ping after another third), so the
  servers heard from us no earlier than ``read_timeout`` = 2/3 of the *negotiated* session
  timeout before the suspension. The session therefore cannot expire on the servers before
  ``suspended_at + timeout/3``: each lease's validity is cut to that (if it is not already
  shorter), minus the clock-drift allowance, and the watchdog reports it lost (interrupting a
  task body with ``LockLost``) when it runs out, before the servers can have expired the
  session. If the connection comes back with the same session first, the cut is lifted.
  This assumes the server we talked to was in touch with the ensemble's leader: a follower cut
  off from its leader keeps answering for up to ``syncLimit * tickTime`` (server settings the
  client cannot read), which should stay well under a third of the session timeout.
* ``LOST`` — the session expired: its nodes are gone and another client may hold the key. Every
  lease is reported lost at once.

After ``fork()`` a child never uses its parent's client (its threads did not survive the fork
and its socket is shared with the parent): the first use in the child makes a new one.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import ConnectionLoss, KazooException, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.serialization import Auth
from kazoo.retry import KazooRetry
from kazoo.security import make_digest_acl

from celery_dlock.backends.zookeeper.nodes import parse_name
from celery_dlock.backends.zookeeper.url import ClientKey, ZkUrl, connect_hint
from celery_dlock.core import forks
from celery_dlock.core.config import drift
from celery_dlock.core.errors import LockUnavailable
from celery_dlock.core.renewal import watchdog

if TYPE_CHECKING:
    from celery_dlock.backends.zookeeper.lease import ZkLease

log = logging.getLogger("celery_dlock.zookeeper")

#: Errors of a kazoo call: the server's answers and a reply that did not come in time.
KAZOO_ERRORS: tuple[type[BaseException], ...] = (KazooException, KazooTimeoutError)
#: The same, and the connection not coming up at all.
UNREACHABLE: tuple[type[BaseException], ...] = (*KAZOO_ERRORS, LockUnavailable)

#: kazoo's most detailed log level, at which it reports the negotiated session timeout.
BLATHER = 5

_serial = itertools.count()


def _handler() -> Any:
    """kazoo's eventlet handler under eventlet's monkey patching (an eventlet worker), else
    None (its threading handler, which gevent's patching makes green as it is).

    kazoo's threading handler waits on its socket with ``selectors``, which eventlet's patching
    does not make work: its connection timed out again and again (a ``-P eventlet -c 50``
    worker's locked tasks hung, then failed with ConnectionLoss). Its timeouts raise
    ``KazooTimeoutError`` here as with the threading handler, which the callers catch.
    """
    patcher: Any = sys.modules.get("eventlet.patcher")
    if patcher is None or not patcher.is_monkey_patched("thread"):
        return None
    from eventlet.green import threading as green_threading  # type: ignore[import-untyped]
    from kazoo.handlers import utils
    from kazoo.handlers.eventlet import SequentialEventletHandler

    class Handler(SequentialEventletHandler):  # type: ignore[misc]
        timeout_exception = KazooTimeoutError

        def async_result(self) -> Any:
            return utils.AsyncResult(self, green_threading.Condition, KazooTimeoutError)

    return Handler()


#: kazoo's own share of the negotiated session timeout after which it gives up on a server
#: (``read_timeout`` in kazoo/protocol/connection.py).
READ_TIMEOUT_SHARE = 2.0 / 3.0


#: kazoo's warnings for a connection attempt that failed (kazoo/protocol/connection.py).
_CONNECT_FAILURES = ("Connection dropped", "Connection time-out")


class _SessionLog(logging.Filter):
    """Reads the negotiated session timeout from kazoo's "Session created" record (and keeps
    kazoo's last connection error, for :meth:`SharedClient.start`'s error; and hides the
    password of the digest ``Auth`` request kazoo logs).

    kazoo keeps the timeout the servers granted only in a local variable and logs it (at its
    BLATHER level, 5); the servers may grant less than was asked (``maxSessionTimeout``), and
    a validity computed from the asked-for timeout would then outlive the session.
    """

    def __init__(self, shared: SharedClient) -> None:
        super().__init__()
        self._shared = shared

    def filter(self, record: logging.LogRecord) -> bool:
        args: Any = record.args
        if isinstance(args, tuple) and any(isinstance(arg, Auth) for arg in args):
            # kazoo logs each request it sends at DEBUG, the digest "user:password" included.
            record.args = tuple(
                arg._replace(auth="***") if isinstance(arg, Auth) else arg for arg in args
            )
        if isinstance(record.msg, str) and record.msg.startswith(_CONNECT_FAILURES):
            # Why the last connection attempt failed (a TLS error, say): start() reports it.
            self._shared.last_error = record.getMessage()
        created = isinstance(record.msg, str) and record.msg.startswith("Session created")
        if created and isinstance(args, tuple) and len(args) >= 3:
            with contextlib.suppress(TypeError, ValueError):
                self._shared.negotiated = float(args[2]) / 1000.0
        return record.levelno > BLATHER  # BLATHER records go no further


class SharedClient:
    """The process's kazoo client for one ensemble (servers, credentials, timeout)."""

    def __init__(self, url: ZkUrl) -> None:
        self.url = url
        self.pid = forks.pid()
        #: Session timeout granted by the servers (seconds); the asked-for one until known.
        self.negotiated: float = url.timeout
        self.leases: set[ZkLease] = set()
        #: Paths of nodes this process has released but whose delete was not confirmed.
        self.owed: set[str] = set()
        #: (parent, nonce) of creates whose reply was lost: any node they made is deleted.
        self.searches: set[tuple[str, str]] = set()
        #: Events of threads waiting for a predecessor; set on LOST (their watch never fires).
        self.waiters: set[threading.Event] = set()
        self.lock = threading.RLock()
        self.suspended_at: float | None = None
        #: Set while the session is connected.
        self.connected = threading.Event()
        #: Events of threads waiting for a reply only while connected; set when it goes.
        self.downs: set[threading.Event] = set()
        #: kazoo's last connection error, for the error when the connection never comes up.
        self.last_error: str | None = None
        self.acl = (
            [make_digest_acl(url.user, url.password, all=True)]
            if url.user is not None and url.password is not None
            else None
        )
        kazoo_log = logging.getLogger(f"celery_dlock.zookeeper.kazoo.{next(_serial)}")
        # Down to kazoo's BLATHER level only while a session is being set up: every packet
        # logs at that level, and a record made per packet would slow every request.
        kazoo_log.setLevel(BLATHER)
        kazoo_log.addFilter(_SessionLog(self))
        self._kazoo_log = kazoo_log
        kazoo_log.propagate = False
        kazoo_log.addHandler(_Forward(logging.getLogger("celery_dlock.zookeeper.kazoo")))
        handler = _handler()
        self.client = KazooClient(
            hosts=url.connect_string,
            timeout=url.timeout,
            auth_data=(
                [("digest", f"{url.user}:{url.password}")] if url.user is not None else None
            ),
            # Reconnect without end, quickly: a lease's validity is counting down meanwhile.
            connection_retry=KazooRetry(
                max_tries=-1,
                delay=0.05,
                backoff=1.5,
                max_delay=max(0.1, url.timeout / 8),
                **({"sleep_func": handler.sleep_func} if handler is not None else {}),
            ),
            logger=kazoo_log,
            **({"handler": handler} if handler is not None else {}),
            **url.kazoo_args(),  # TLS, for zookeepers://
        )
        self.client.add_listener(self._on_state)
        self._started = False
        self._closing = False

    # -- connection --------------------------------------------------------------------------

    @property
    def op_timeout(self) -> float:
        """How long one request may wait for its reply: the session timeout."""
        return self.negotiated

    def call(self, send: Callable[[], Any], timeout: float | None = None) -> Any:
        """Send a request (``send()`` returns kazoo's async result) and wait for the reply,
        sending it again after a ``ConnectionLoss``: the session (and our nodes) may well
        survive a dropped connection, and kazoo holds a request until it reconnects. Only
        for requests that are safe to repeat (reads, deletes). Waits ``timeout`` seconds
        at most (the session timeout by default)."""
        deadline = time.monotonic() + (self.op_timeout if timeout is None else timeout)
        while True:
            try:
                return send().get(timeout=max(0.001, deadline - time.monotonic()))
            except ConnectionLoss:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                self.connected.wait(min(left, 0.1))

    def answer(self, result: Any, timeout: float | None = None) -> Any:
        """The reply to a request already sent (kazoo's async ``result``), waiting for it no
        longer than the connection is up (and ``timeout``, the session timeout by default):
        ``ConnectionLoss`` at once when it is down. For requests whose failure is handled
        later anyway (a delete owed until it lands), so that their caller is not kept a
        session timeout for a reply that an outage delays."""
        event = threading.Event()
        result.rawlink(lambda _result: event.set())
        with self.lock:
            down = not self.connected.is_set()
            self.downs.add(event)
        try:
            if not down:
                event.wait(self.op_timeout if timeout is None else timeout)
        finally:
            with self.lock:
                self.downs.discard(event)
        if result.ready():
            return result.get()
        if down or not self.connected.is_set():
            raise ConnectionLoss("no connection to ZooKeeper: the reply is not awaited")
        raise KazooTimeoutError("no reply from ZooKeeper in time")

    def start(self) -> KazooClient:
        """The connected client; :class:`LockUnavailable` when no server answers in time."""
        if self._started:
            return self.client
        with self.lock:
            if not self._started:
                self._closing = False
                self.last_error = None
                try:
                    self.client.start(timeout=self.url.timeout)
                except KAZOO_ERRORS as exc:
                    self.client.stop()
                    detail = self._failure(exc)
                    raise LockUnavailable(
                        f"cannot connect to ZooKeeper at {self.url.shown}: {detail}",
                        errors=[(self.url.shown, detail)],
                    ) from exc
                self._started = True
                self.connected.set()
        return self.client

    def _failure(self, exc: BaseException) -> str:
        """Why the connection did not come up: kazoo's timeout, its last error, the fix."""
        detail = str(exc) or type(exc).__name__
        last = self.last_error
        if last:
            detail = f"{detail} (last error: {last})"
            hint = connect_hint(self.url, last)
            if hint is not None:
                detail = f"{detail}; {hint}"
        return detail

    def stop(self) -> None:
        """Close the session (its nodes go at once) and the connection."""
        with self.lock:
            started, self._started = self._started, False
            self._closing = True
        # Not under self.lock: stopping waits for kazoo's thread, which calls _on_state.
        if started and self.pid == forks.pid():
            self.client.stop()
            self.client.close()

    # -- leases ------------------------------------------------------------------------------

    def safe_until(self, suspended_at: float) -> float:
        """The monotonic time before which the session cannot have expired on the servers,
        for a connection kazoo declared lost at ``suspended_at`` (see the module docstring)."""
        timeout = self.negotiated
        last_heard = suspended_at - READ_TIMEOUT_SHARE * timeout
        return last_heard + timeout - drift(timeout)

    def add(self, lease: ZkLease) -> None:
        with self.lock:
            self.leases.add(lease)
            if self.suspended_at is not None:  # won just as the connection went
                lease.suspend(self.safe_until(self.suspended_at))

    def discard(self, lease: ZkLease) -> None:
        with self.lock:
            self.leases.discard(lease)

    def let_go(self, lease: ZkLease) -> bool:
        """Mark ``lease`` released, and stop renewing and tracking it (under its ``io_lock``).
        True when this process is now to end or keep its node: False when it was released
        already, or is the parent's lease inherited by fork (the parent ends it)."""
        if not lease.set_released():
            return False
        watchdog.discard(lease)
        self.discard(lease)
        return lease.pid == forks.pid()

    def _on_state(self, state: str) -> None:
        """kazoo's session listener (on kazoo's connection thread: nothing here may block)."""
        with self.lock:
            leases = list(self.leases)
            if state != KazooState.CONNECTED:
                self.connected.clear()
                for event in self.downs:
                    event.set()
                self._kazoo_log.setLevel(BLATHER)  # to read the next session's timeout
            else:
                self._kazoo_log.setLevel(logging.NOTSET)
            if state == KazooState.SUSPENDED:
                now = time.monotonic()
                self.suspended_at = now
                until = self.safe_until(now)
                log.warning(
                    "ZooKeeper connection lost (%s); %d lease(s) valid for at most %.3f s more "
                    "unless it comes back",
                    self.url.shown,
                    len(leases),
                    max(0.0, until - now),
                )
                for lease in leases:
                    lease.suspend(until)
            elif state == KazooState.LOST:
                self.suspended_at = None
                self.leases.clear()
                self.owed.clear()  # the session's nodes are gone with it
                for event in self.waiters:
                    event.set()
                reason = (
                    "this process closed its ZooKeeper session (client stopped, or the process "
                    "exiting): its lock node is gone"
                    if self._closing
                    else "the ZooKeeper session expired: its lock node is gone and another "
                    "client may hold the key"
                )
                for lease in leases:
                    watchdog.discard(lease)
                    lease.lose(reason)  # callbacks off this thread (see ZkLease.lose)
            else:  # CONNECTED: the same session again (a new one follows LOST)
                self.connected.set()
                self.suspended_at = None
                for lease in leases:
                    lease.resume()
                if self.owed or self.searches:
                    threading.Thread(
                        target=self._pay_owed, name="dlock-zk-release", daemon=True
                    ).start()

    def owe(self, path: str) -> None:
        """Remember that the node at ``path`` must still be deleted (a delete that failed or
        went unanswered), and pay at once if connected: the reconnection that would pay it
        may have come before this call."""
        with self.lock:
            self.owed.add(path)
        if self.client.state == KazooState.CONNECTED:
            threading.Thread(target=self._pay_owed, name="dlock-zk-release", daemon=True).start()

    def disown(self, created: Any, parent: str, nonce: str) -> None:
        """An acquisition whose create (kazoo's async result ``created``, of the node with
        ``nonce`` under ``parent``) went unanswered, and whose caller was told it failed: the
        node it makes, whenever it is made, is deleted.

        kazoo keeps a request made while the connection is down and sends it on reconnection,
        long after its caller stopped waiting; a node made then would sit in line, and hold
        the key, for as long as the session lives. A create that is answered later is deleted
        by its path; one whose reply was lost (``ConnectionLoss``) by a search of the parent
        for its nonce, once connected (and again at each reconnection until a search is
        answered)."""

        def check(result: Any) -> None:
            try:
                path = result.get()[0]
            except ConnectionLoss:
                self.search(parent, nonce)
                return
            except KAZOO_ERRORS:
                return  # not made: parent missing, session over, client closed
            self.owe(path)

        created.rawlink(check)

    def search(self, parent: str, nonce: str) -> None:
        """Remember to delete any child of ``parent`` made by the acquisition ``nonce``."""
        with self.lock:
            self.searches.add((parent, nonce))
        if self.client.state == KazooState.CONNECTED:
            threading.Thread(target=self._pay_owed, name="dlock-zk-release", daemon=True).start()

    def _pay_owed(self) -> None:
        """Delete the nodes whose release did not get through, and those of creates whose
        caller was told they failed (:meth:`disown`), now that we are back."""
        with self.lock:
            owed, self.owed = set(self.owed), set()
            searches, self.searches = set(self.searches), set()
        for parent, nonce in searches:
            try:
                children = self.call(partial(self.client.get_children_async, parent))
            except NoNodeError:
                continue
            except KAZOO_ERRORS:
                with self.lock:
                    self.searches.add((parent, nonce))
                continue
            owed.update(
                f"{parent}/{child}"
                for child in children
                if (name := parse_name(child)) is not None and name.nonce == nonce
            )
        for path in owed:
            try:
                self.call(partial(self.client.delete_async, path))
            except NoNodeError:
                pass
            except KAZOO_ERRORS:
                with self.lock:
                    self.owed.add(path)


class _Forward(logging.Handler):
    """Passes kazoo's records (DEBUG and up) on to one logger of ours."""

    def __init__(self, target: logging.Logger) -> None:
        super().__init__()
        self._target = target

    def emit(self, record: logging.LogRecord) -> None:
        if self._target.isEnabledFor(record.levelno):
            self._target.handle(record)


_registry_lock = threading.Lock()
_registry_pid = forks.pid()
_clients: dict[ClientKey, SharedClient] = {}


def shared(url: ZkUrl) -> SharedClient:
    """The process's client for ``url``'s servers; a new one in a forked child."""
    global _registry_pid
    with _registry_lock:
        if _registry_pid != forks.pid():
            # Forked: the parent's clients (threads gone, socket shared) are not ours to use
            # or to close; a close would end the parent's session.
            _clients.clear()
            _registry_pid = forks.pid()
        key = url.client_key()
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = SharedClient(url)
        return client


def close_all() -> None:
    """Stop every client of this process: its sessions end now, and their nodes go with them
    (at exit, so a lock a process still held is free at once, not a session timeout later)."""
    with _registry_lock:
        clients = list(_clients.values()) if _registry_pid == forks.pid() else []
        _clients.clear()
    for client in clients:
        client.stop()


atexit.register(close_all)
