"""Hearing Sentinel's ``+switch-master`` announcements as they happen.

A connection to a Sentinel-managed master learns the master's address only when it connects.
After a planned failover (``SENTINEL FAILOVER``) the old master stays a writable master until
Sentinel demotes it, seconds later: a connection that stays open would keep renewing leases
there while the new master's copies of their keys expire, and someone else could then take a
key on the new master while its holder still believes it holds it.

So every process that uses a ``redis+sentinel://`` entry subscribes to ``+switch-master`` on
each of its sentinels (redis-py's pubsub, on the sentinel clients redis-py's ``Sentinel``
already keeps). When one announces a new master for the service, the node records its address
(:meth:`celery_dlock.backends.redis.nodes.SentinelNode.switched_to`); from then on no connection of
the process sends anything to another address: each is dropped at its next use and opened again
through the sentinels, the announcing one asked first, and the renewal watchdog renews this
node's leases at once, on the new master.

Each announcement is paired with the configuration epoch the announcing sentinel gives it
(``SENTINEL MASTERS``, which redis-py's master lookup uses anyway). An older one (a sentinel
that lags) is ignored; and a connection the sentinels send to another master is followed,
not refused, when they name it under a newer epoch: a failover this process did not hear
(a pool process forked after its parent heard one failover, then a second one before it
subscribed; subscriptions down during a failover), which would otherwise refuse the master
for good.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Protocol

from redis.exceptions import RedisError, ResponseError

log = logging.getLogger("celery_dlock.failover")

#: The channel every sentinel announces a completed failover on.
CHANNEL = "+switch-master"
#: Longest wait for one announcement before the listener checks whether it should stop.
LISTEN_TICK = 1.0
#: Pause before subscribing again to a sentinel that closed the subscription; doubled after
#: each failure in a row, up to RESUBSCRIBE_MAX.
RESUBSCRIBE_PAUSE = 0.25
RESUBSCRIBE_MAX = 10.0


class Watched(Protocol):
    """What a listener needs of the node it serves
    (:class:`celery_dlock.backends.redis.nodes.SentinelNode`, whose module starts the listeners, so
    this one must not import it)."""

    @property
    def shown(self) -> str: ...

    @property
    def service(self) -> str: ...

    @property
    def announcement(self) -> tuple[tuple[str, int], int | None] | None: ...

    def switched_to(self, address: tuple[str, int], epoch: int | None = None) -> None: ...


class SwitchWatch:
    """One listener thread per sentinel of one node, alive until :meth:`close`."""

    def __init__(self, node: Watched, sentinel_manager: Any) -> None:
        self._node = node
        self._manager = sentinel_manager  # redis.sentinel.Sentinel: its .sentinels are clients
        self._stop = threading.Event()
        for client in list(sentinel_manager.sentinels):
            threading.Thread(
                target=self._listen,
                args=(client,),
                name=f"dlock-sentinel-{_address(client)}",
                daemon=True,
            ).start()

    def close(self) -> None:
        self._stop.set()

    def _listen(self, client: Any) -> None:
        failures = 0
        warned = False
        while not self._stop.is_set():
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(CHANNEL)
                failures = 0
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=LISTEN_TICK)
                    if message is not None and message.get("type") == "message":
                        self._heard(client, message["data"])
            except ResponseError as exc:  # refused (an ACL user without +subscribe)
                failures += 1
                if not warned:
                    warned = True
                    log.warning(
                        "%s: sentinel %s refuses to let this client subscribe to %s (%s); "
                        "a failover is noticed only when the old master refuses writes or "
                        "closes the connection: grant the sentinel user +subscribe &%s",
                        self._node.shown,
                        _address(client),
                        CHANNEL,
                        exc,
                        CHANNEL,
                    )
            except (RedisError, OSError) as exc:
                failures += 1
                log.debug("subscription to sentinel %s lost: %s", _address(client), exc)
            except Exception:  # never let a listener die silently
                failures += 1
                log.exception("sentinel listener failed")
            finally:
                with contextlib.suppress(Exception):
                    pubsub.close()
            self._stop.wait(min(RESUBSCRIBE_PAUSE * 2 ** min(failures, 8), RESUBSCRIBE_MAX))

    def _heard(self, client: Any, data: Any) -> None:
        text = data.decode() if isinstance(data, bytes) else str(data)
        parts = text.split()
        if len(parts) != 5 or parts[0] != self._node.service or not parts[4].isdigit():
            return
        # Ask the announcing sentinel first from now on: the others may lag behind it by up to
        # their hello period, and would name the old master to a connection opened meanwhile.
        sentinels = self._manager.sentinels
        if client in sentinels:
            sentinels[:] = [client, *(s for s in sentinels if s is not client)]
        address = (parts[3], int(parts[4]))
        before = self._node.announcement
        if before is None or before[1] is None:
            # Nothing to compare an epoch with: act at once, then learn the epoch (a sentinel
            # slow to answer must not delay the switch).
            self._node.switched_to(address)
        self._node.switched_to(address, _epoch(client, self._node.service, address))


def _view(client: Any, service: str) -> tuple[tuple[str, int], int] | None:
    """The master ``client``'s sentinel names for ``service`` and its configuration epoch
    (``SENTINEL MASTERS``, which redis-py's master lookup needs anyway); None if it cannot
    say."""
    try:
        state = client.sentinel_masters().get(service)
        if not state:
            return None
        return (str(state["ip"]), int(state["port"])), int(state["config-epoch"])
    except (RedisError, OSError, KeyError, TypeError, ValueError):
        return None


def _epoch(client: Any, service: str, address: tuple[str, int]) -> int | None:
    """The configuration epoch under which the sentinel that just announced ``address``
    names it master; None if it cannot say, or already names another."""
    view = _view(client, service)
    return view[1] if view is not None and view[0] == address else None


def newer_master(
    manager: Any,
    service: str,
    announcement: tuple[tuple[str, int], int | None],
    address: tuple[str, int],
) -> int | None:
    """The epoch under which a sentinel names ``address`` master, if that configuration is
    newer than ``announcement`` (the master last announced here, with its epoch); else None.

    A connection that a sentinel sent to another address than the one announced is either
    following a sentinel that lags behind the announcement (an older epoch: refused) or one
    that moved on through a failover this process did not hear (a newer epoch: followed).
    When the announcement's epoch is unknown, the newest epoch any sentinel gives the
    announced address stands for it; if none names that address any more, a majority of the
    sentinels listed must name ``address``.
    """
    announced, floor = announcement
    sentinels = list(manager.sentinels)
    views = [view for client in sentinels if (view := _view(client, service))]
    naming = [epoch for named, epoch in views if named == address]
    if floor is None:
        floor = max((epoch for named, epoch in views if named == announced), default=None)
        if floor is None:  # none names the announced master: follow a majority, if any
            return max(naming) if len(naming) > len(sentinels) // 2 else None
    newer = [epoch for epoch in naming if epoch > floor]
    return max(newer) if newer else None


def _address(client: Any) -> str:
    kwargs = client.connection_pool.connection_kwargs
    return f"{kwargs.get('host')}:{kwargs.get('port')}"
