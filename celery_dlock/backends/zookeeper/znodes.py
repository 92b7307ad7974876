"""The few node requests every part of the ZooKeeper backend sends: read a node, find an
acquisition's node by its nonce, delete a node (version-checked, or owed until it lands),
stamp the leader's clock, create a key's parent as a container node."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError
from kazoo.protocol.serialization import Create2
from kazoo.protocol.states import ZnodeStat
from kazoo.security import OPEN_ACL_UNSAFE

from celery_dlock.backends.zookeeper.nodes import parse_name
from celery_dlock.backends.zookeeper.session import KAZOO_ERRORS, SharedClient

log = logging.getLogger("celery_dlock.zookeeper")

#: ZooKeeper's CreateMode.CONTAINER flag.
CONTAINER = 4


class _CreateContainer(Create2):  # type: ignore[misc]  # kazoo is untyped
    """ZooKeeper's ``createContainer`` request (opcode 19; kazoo has no call for it): the
    same fields and reply as ``create2``."""

    type = 19


def make_parent(client: KazooClient, session: SharedClient, parent: str, base: str) -> None:
    """Create a key's parent as a container node (and the base path, persistent).

    A container node (ZooKeeper 3.5.3+) is deleted by the servers once its last child is gone
    (checked every ``znode.container.checkIntervalMs``, a minute by default), so keys used
    once do not accumulate parents."""
    acl = session.acl or OPEN_ACL_UNSAFE
    for _ in range(3):
        result = client.handler.async_result()
        # kazoo has no call for createContainer: send its request as kazoo's create does.
        client._call(_CreateContainer(parent, b"", acl, CONTAINER), result)
        try:
            result.get(timeout=session.op_timeout)
            return
        except NodeExistsError:
            return
        except NoNodeError:
            client.ensure_path_async(base, session.acl).get(timeout=session.op_timeout)


def find(
    client: KazooClient,
    session: SharedClient,
    parent: str,
    nonce: str,
    *,
    replacement: bool = False,
) -> tuple[str, ZnodeStat] | None:
    """The child made by the acquisition ``nonce`` (its replacement, when ``replacement``:
    a child whose name inherits an order), with its stat; None when there is none."""
    try:
        children = session.call(lambda: client.get_children_async(parent))
    except NoNodeError:
        return None
    for child in children:
        parsed = parse_name(child)
        if parsed is None or parsed.nonce != nonce:
            continue
        if replacement and parsed.order == parsed.seq:
            continue
        path = f"{parent}/{child}"
        stat = session.call(partial(client.exists_async, path))
        return (path, stat) if stat is not None else None
    return None


def stamp(client: KazooClient, session: SharedClient, base: str) -> tuple[int, float]:
    """A fresh stamp of the leader's clock (ms): the ``mtime`` of an empty ``setData`` on
    the ``base`` node above every key (nobody watches its data; a key's parent's data
    version counts replacements, see :mod:`celery_dlock.backends.zookeeper.decisions`), and when its
    reply arrived."""
    stat = session.call(partial(client.set_async, base, b""))
    return int(stat.mtime), time.monotonic()


def reap(client: KazooClient, session: SharedClient, path: str, version: int) -> None:
    """Delete an expired timed node, if it is still the version we read."""
    try:
        session.call(partial(client.delete_async, path, version))
        log.debug("deleted expired timed node %s", path)
    except KAZOO_ERRORS:
        pass  # gone, changed (adopted), or unreachable: the caller lists again


def read(
    client: KazooClient, session: SharedClient, path: str, watch: Any = None
) -> tuple[bytes, ZnodeStat] | None:
    """A node's data and stat, None when it is gone."""
    try:
        raw, stat = session.call(partial(client.get_async, path, watch=watch))
    except NoNodeError:
        return None
    return raw, stat


def abandon(client: KazooClient, session: SharedClient, path: str) -> None:
    """Delete our queue node after a refusal or an error (owed until it lands)."""
    try:
        session.answer(client.delete_async(path))
    except NoNodeError:
        pass
    except KAZOO_ERRORS:
        session.owe(path)


def owe_if_failed(session: SharedClient, path: str) -> Callable[[Any], None]:
    """A callback for a delete's async result: owe the delete when it did not land."""

    def check(result: Any) -> None:
        try:
            result.get()
        except NoNodeError:
            pass
        except KAZOO_ERRORS:
            session.owe(path)

    return check
