"""The ZooKeeper backend: ``dlock_urls = ["zookeeper://h1:2181,h2:2181,h3:2181/celery-dlock"]``
(``zookeepers://`` for TLS).

Needs kazoo (``pip install celery-dlock[zookeeper]``). The lock recipe is described in
:mod:`celery_dlock.backends.zookeeper.line`, its fencing token in
:mod:`celery_dlock.backends.zookeeper.decisions`, timed nodes (queued locks, hand-overs, forgotten
leases) in
:mod:`celery_dlock.backends.zookeeper.timed`, a lease's validity in
:mod:`celery_dlock.backends.zookeeper.lease`; how the session's states map onto a lease's validity
in :mod:`celery_dlock.backends.zookeeper.session`; the URL in
:mod:`celery_dlock.backends.zookeeper.url`. :mod:`celery_dlock.backends.zookeeper.lock` (the
backend) lists every module by layer.
"""

from __future__ import annotations

from collections.abc import Sequence

from celery_dlock.backends.zookeeper.lease import ZkLease
from celery_dlock.backends.zookeeper.lock import ZooKeeperBackend
from celery_dlock.backends.zookeeper.session import close_all
from celery_dlock.backends.zookeeper.url import ZkUrl, is_zookeeper, parse
from celery_dlock.core.backend import Backend
from celery_dlock.core.config import Settings
from celery_dlock.core.errors import ConfigError
from celery_dlock.core.urls import redact

__all__ = [
    "ZkLease",
    "ZkUrl",
    "ZooKeeperBackend",
    "check_urls",
    "close_all",
    "is_zookeeper",
    "make_backend",
    "parse",
]


def check_urls(urls: Sequence[str], setting: str = "dlock_urls") -> tuple[str, ...]:
    """What :mod:`celery_dlock.core.config` asks of a backend module: the URLs, checked. One
    ``zookeeper://`` URL names a whole ensemble (every server in its host list)."""
    if len(urls) != 1:
        shown = ", ".join(repr(redact(url)) for url in urls)
        raise ConfigError(
            f"{setting} has {len(urls)} ZooKeeper URLs ({shown}): one URL names a whole "
            "ensemble; list its servers in that one URL, e.g. "
            "'zookeeper://h1:2181,h2:2181,h3:2181/celery-dlock'."
        )
    parse(urls[0], setting)
    return tuple(urls)


def make_backend(settings: Settings) -> Backend:
    """The ZooKeeper backend for settings whose URL :func:`check_urls` accepted."""
    return ZooKeeperBackend(settings)
