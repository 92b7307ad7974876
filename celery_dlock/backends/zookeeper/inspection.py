"""The operator's side of the ZooKeeper backend (:mod:`celery_dlock.ops.admin`, ``celery dlock``):
who holds a key and who waits, every key, forced releases, and whether each server serves."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from urllib.parse import unquote

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from celery_dlock.backends.zookeeper import decisions
from celery_dlock.backends.zookeeper.decisions import serving
from celery_dlock.backends.zookeeper.keyspace import Keyspace
from celery_dlock.backends.zookeeper.nodes import (
    NodeName,
    expires_ms,
    in_line,
    parse_name,
    read_holder,
)
from celery_dlock.backends.zookeeper.session import KAZOO_ERRORS, SharedClient
from celery_dlock.backends.zookeeper.url import ZkUrl
from celery_dlock.backends.zookeeper.znodes import reap
from celery_dlock.core.config import check_key
from celery_dlock.core.holder import Holder, LockInfo

log = logging.getLogger("celery_dlock.zookeeper")


def _nodes(space: Keyspace, key: str) -> tuple[KazooClient, SharedClient, str, list[NodeName], int]:
    """The key's parent, its children in line order (empty when none), and the first part of
    its tokens (:func:`celery_dlock.backends.zookeeper.decisions.birth`)."""
    session, client = space.client()
    parent = space.parent(key)
    try:
        children, listed = client.get_children_async(parent, include_data=True).get(
            timeout=session.op_timeout
        )
    except NoNodeError:
        children, listed = [], None
    except KAZOO_ERRORS as exc:
        raise space.unavailable(key, "inspect", exc) from exc
    return client, session, parent, in_line(list(children)), decisions.birth(listed)


def _holder_node(space: Keyspace, key: str) -> tuple[str, Holder, int | None] | None:
    """The holder's node, identity and (a timed node) ms of life left; None when nobody
    holds ``key``. An expired timed node found first in line is deleted on the way."""
    for _ in range(5):  # a release between the listing and the read: list again
        client, session, parent, children, birth = _nodes(space, key)
        if not children:
            return None
        head = children[0]
        path = f"{parent}/{head.name}"
        try:
            stamp = client.set_async(space.base, b"") if head.timed else None
            raw, stat = client.get_async(path).get(timeout=session.op_timeout)
            now_ms = int(stamp.get(timeout=session.op_timeout).mtime) if stamp else 0
        except NoNodeError:
            continue
        except KAZOO_ERRORS as exc:
            raise space.unavailable(key, "inspect", exc) from exc
        left: int | None = None
        if head.timed:
            left = expires_ms(raw, stat, space.ttl) - now_ms
            if left <= 0:
                reap(client, session, path, stat.version)
                continue
        holder = read_holder(raw, stat, birth + head.seq)
        if holder is not None:
            return path, holder, left
        return None
    return None


def holder(space: Keyspace, key: str) -> Holder | None:
    """The current holder (the first node's identity), or None when nobody holds ``key``."""
    found = _holder_node(space, check_key(key))
    return found[1] if found else None


def inspect(space: Keyspace, key: str) -> LockInfo:
    """The key's holder; the time left only for a timed node (a session node's lease
    lasts as long as its session)."""
    found = _holder_node(space, check_key(key))
    if found is None:
        return LockInfo(key, None, None, None)
    _, holder, left = found
    return LockInfo(key, holder, None if left is None else left / 1000.0, holder.fence)


def queue(space: Keyspace, key: str) -> list[Holder]:
    """The holder and every waiter of ``key``, in the order they will hold it."""
    client, session, parent, children, birth = _nodes(space, check_key(key))
    reads = [client.get_async(f"{parent}/{child.name}") for child in children]
    out: list[Holder] = []
    for child, read in zip(children, reads, strict=True):
        try:
            raw, stat = read.get(timeout=session.op_timeout)
        except NoNodeError:
            continue
        holder = read_holder(raw, stat, birth + child.seq)
        if holder is not None:
            out.append(holder)
    return out


def locks(space: Keyspace, prefix: str = "") -> list[LockInfo]:
    """Every key starting with ``prefix`` that has a parent node (free keys included)."""
    session, client = space.client()
    try:
        names = client.get_children_async(space.base).get(timeout=session.op_timeout)
    except NoNodeError:
        names = []
    except KAZOO_ERRORS as exc:
        raise space.unavailable(prefix, "list locks", exc) from exc
    keys = sorted(k for k in (unquote(n) for n in names) if k.startswith(prefix))
    return [inspect(space, key) for key in keys]


def _delete(space: Keyspace, key: str, path: str) -> bool:
    """Delete the node ``path`` of ``key``; True if deleted (False: already gone)."""
    session, client = space.client()
    try:
        client.delete_async(path).get(timeout=session.op_timeout)
    except NoNodeError:
        return False
    except KAZOO_ERRORS as exc:
        raise space.unavailable(key, "release", exc) from exc
    return True


def _delete_if(space: Keyspace, key: str, match: Callable[[NodeName, Holder], bool]) -> bool:
    """Delete the holder's node if ``match(its parsed name, holder)``; True if deleted."""
    found = _holder_node(space, key)
    if found is None:
        return False
    parsed = parse_name(found[0].rsplit("/", 1)[1])
    if parsed is None or not match(parsed, found[1]):
        return False
    return _delete(space, key, found[0])


def force_release(space: Keyspace, key: str, holder: Holder) -> bool:
    """Delete ``holder``'s node: its watch tells the holder its lease is lost, and the
    next waiter is admitted."""
    key = check_key(key)
    released = _delete_if(space, key, lambda name, h: name.nonce == holder.nonce)
    if released:
        log.warning("forced release of key=%s held by %s", key, holder.describe())
    return released


def release_nonce(space: Keyspace, key: str, nonce: str) -> bool:
    """Delete the node of the acquisition with ``nonce`` on ``key``: the holder's, or a
    waiter's (its process ended, and its place in line would hold up those behind it
    until its session expired)."""
    key = check_key(key)
    if _delete_if(space, key, lambda name, h: name.nonce == nonce):
        return True
    _, _, parent, children, _ = _nodes(space, key)
    for child in children[1:]:
        if child.nonce == nonce:
            return _delete(space, key, f"{parent}/{child.name}")
    return False


def release_by_task(space: Keyspace, key: str, task_id: str) -> bool:
    """Delete ``key``'s node if task ``task_id`` holds it, whichever acquisition."""
    return _delete_if(space, check_key(key), lambda name, h: h.task_id == task_id)


def endpoints(url: ZkUrl, base: str) -> list[str]:
    """One line per server of the ensemble, credentials hidden, with the chroot."""
    who = f"{url.user}:***@" if url.user is not None else ""
    return [
        f"zookeeper://{who}{host if ':' not in host else f'[{host}]'}:{port}{base}"
        for host, port in url.hosts
    ]


def check(space: Keyspace) -> list[tuple[str, str | None]]:
    """Ask each server whether it serves clients (``srvr``, allowed by ZooKeeper's
    default four-letter-word whitelist): ``(endpoint, error)``, None when it does."""
    url = space.url
    out: list[tuple[str, str | None]] = []
    for endpoint, (host, port) in zip(endpoints(url, space.base), url.hosts, strict=True):
        try:
            with socket.create_connection((host, port), timeout=url.timeout) as sock:
                sock.sendall(b"srvr")
                answer = b""
                while chunk := sock.recv(4096):
                    answer += chunk
        except OSError as exc:
            out.append((endpoint, str(exc) or type(exc).__name__))
            continue
        out.append((endpoint, serving(answer)))
    return out
