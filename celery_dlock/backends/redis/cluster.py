"""A Redis Cluster as one lock node: each call routed by its keys' hash slot to the master
that owns it, following MOVED, ASK and TRYAGAIN; and :func:`node_for`, which picks a URL's node.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import redis
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_dlock.backends.redis import diagnose, endpoints
from celery_dlock.backends.redis.nodes import Node, Reply, SentinelNode, is_connected
from celery_dlock.backends.redis.owed import drain, read
from celery_dlock.backends.redis.transport import run_script
from celery_dlock.core import forks

#: Redirections (MOVED, ASK) and TRYAGAIN retries one Cluster call follows before giving up.
CLUSTER_REDIRECTS = 5
#: Pause before retrying a TRYAGAIN (keys of one slot split by a migration in progress).
TRYAGAIN_PAUSE = 0.01


class ClusterNode(Node):
    """A whole Redis Cluster as one lock node: each call goes to the master of its keys' slot.

    Every key one lock touches carries the hash tag ``{key}`` (``LockManager.redis_keys``), so
    each call names keys of a single slot. redis-py's ``RedisCluster`` keeps the slot map; it
    is made on first use (it connects). Each master is a :class:`Shard`, reached over the same
    per-thread connections as a plain node, so a routed call costs what a plain one does.

    MOVED reloads the slot map and sends the call again; ASK sends it once to the importing
    master after ``ASKING``; TRYAGAIN (a slot half migrated) is retried briefly. Any other
    failure (a dead master, CLUSTERDOWN) is the call's reply, and the slot map is reloaded
    before the next call, which finds the master a failover promoted.
    """

    cluster = True

    def __init__(self, url: str, timeout: float, prefix: str = "dlock") -> None:
        # No Node.__init__: a cluster has no one client.
        self.url = url
        self.prefix = prefix
        self.endpoint = endpoints.parse(url)
        self.shown = self.endpoint.shown
        self.timeout = timeout
        self._down_until = 0.0
        self._reset()

    def _reset(self) -> None:
        self._pid = forks.pid()
        self._guard = threading.Lock()
        self._cluster: Any = None  # redis.cluster.RedisCluster, made on first use
        self._shards: dict[str, Shard] = {}
        self._reload = False

    def __repr__(self) -> str:
        return f"<ClusterNode {self.shown}>"

    def cluster_client(self) -> Any:
        """redis-py's ``RedisCluster`` for this node; ``ConnectionError`` if none answers."""
        if self._pid != forks.pid():
            self._reset()  # a forked child makes its own client, sockets and locks
        client = self._cluster
        if client is None:
            with self._guard:
                if self._cluster is None:
                    try:
                        self._cluster = self.endpoint.client(self.timeout)
                    except (RedisError, RedisClusterException, OSError) as exc:
                        refused = diagnose.refusal(exc)
                        if isinstance(refused, RedisError):  # an ACL user lacks a grant
                            raise refused from exc
                        raise RedisConnectionError(f"cannot reach the cluster: {exc}") from exc
                client = self._cluster
        return client

    def reload_later(self) -> None:
        """Reload the slot map before the next call (after MOVED or a failed master)."""
        self._reload = True

    def route(self, key: str) -> Shard:
        """The master that owns ``key``'s hash slot; ``RedisError`` when none does."""
        client = self.cluster_client()
        if self._reload:
            self._reload = False
            try:
                client.nodes_manager.initialize()
            except (RedisError, RedisClusterException, OSError) as exc:
                self._reload = True
                raise RedisConnectionError(
                    f"cannot reload the slots of {self.shown}: {exc}"
                ) from exc
        try:
            master = client.nodes_manager.get_node_from_slot(key_slot(key.encode()))
        except (RedisClusterException, KeyError, IndexError) as exc:
            self._reload = True
            raise ClusterDownError(
                f"{self.shown}: no master serves the slot of {key!r}: {exc}"
            ) from exc
        return self._shard(client, master)

    def _shard(self, client: Any, master: Any) -> Shard:
        shard = self._shards.get(master.name)
        if shard is None:
            with self._guard:
                shard = self._shards.get(master.name)
                if shard is None:
                    redis_client = client.get_redis_connection(master)
                    shard = self._shards[master.name] = Shard(self, master.name, redis_client)
        return shard

    def run(self, name: str, keys: Sequence[str], args: Sequence[Any], timeout: float) -> Reply:
        """Run script ``name`` on the master of ``keys``' slot: its reply, or an exception."""
        deadline = time.monotonic() + timeout
        reply: Reply = None
        for _ in range(CLUSTER_REDIRECTS):
            left = deadline - time.monotonic()
            try:
                shard = self.route(keys[0])
            except RedisError as exc:
                return exc
            reply = run_script([shard], name, keys, args, max(left, 0.001))[0]
            if isinstance(reply, AskError) and not isinstance(reply, MovedError):
                reply = self._ask(reply, name, keys, args)
            if isinstance(reply, AskError):  # MOVED, or MOVED back from the importing master
                self.reload_later()
            elif isinstance(reply, TryAgainError):
                time.sleep(max(0.0, min(TRYAGAIN_PAUSE, deadline - time.monotonic())))
            else:
                if isinstance(reply, RedisConnectionError | RedisTimeoutError | ClusterDownError):
                    self.reload_later()
                return reply
            if time.monotonic() >= deadline:
                break
        return reply

    def _ask(self, asked: AskError, name: str, keys: Sequence[str], args: Sequence[Any]) -> Reply:
        """Send the call once to the master importing the slot, after ``ASKING``.

        Sent as source (``EVAL``): a retry after NOSCRIPT would lack the ``ASKING``. Blocks up
        to the socket timeout: this happens only while an operator migrates the slot.
        """
        try:
            client = self.cluster_client()
            master = client.get_node(host=asked.host, port=asked.port)
        except RedisError as exc:
            return exc
        if master is None:  # a master the slot map does not know yet
            self.reload_later()
            return asked
        shard = self._shard(client, master)
        conn = shard.connection()
        try:
            if not is_connected(conn):
                conn.connect()
            drain(shard, conn)
            source = shard.scripts[name].script
            commands = [("ASKING",), ("EVAL", source, len(keys), *keys, *args)]
            conn.send_packed_command(conn.pack_commands(commands), check_health=False)
            asking = read(conn)
            reply = read(conn)
        except (RedisError, OSError) as exc:
            conn.disconnect()
            return exc
        except BaseException:
            conn.disconnect()
            raise
        return asking if isinstance(asking, BaseException) else reply

    def close(self) -> None:
        """Close this thread's connections to every master and the cluster client."""
        for shard in list(self._shards.values()):
            shard.close()
        if self._cluster is not None:
            self._cluster.close()


class Shard(Node):
    """One master of a Redis Cluster, reached like a plain node (see :class:`ClusterNode`)."""

    def __init__(self, owner: ClusterNode, name: str, client: redis.Redis) -> None:
        self.url = owner.url
        self.prefix = owner.prefix
        self.endpoint = owner.endpoint
        self.owner = owner
        self._setup(f"{owner.shown} (master {name})", owner.timeout, client)

    def __repr__(self) -> str:
        return f"<Shard {self.shown}>"

    def close(self) -> None:
        """Close this thread's connections; the cluster client owns the master's pool."""
        self._close_connections()


def node_for(url: str, timeout: float, prefix: str = "dlock") -> Node:
    """The lock node for one ``dlock_urls`` entry: a :class:`ClusterNode` for a Cluster URL."""
    kind = endpoints.parse(url).kind
    if kind == "cluster":
        return ClusterNode(url, timeout, prefix)
    if kind == "sentinel":
        return SentinelNode(url, timeout, prefix)
    return Node(url, timeout, prefix)
