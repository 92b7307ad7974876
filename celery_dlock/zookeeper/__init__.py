"""The ZooKeeper backend: ``dlock_urls = ["zookeeper://h1:2181,h2:2181,h3:2181/celery-dlock"]``.

Needs kazoo (``pip install celery-dlock[zookeeper]``). The lock recipe and its fencing token
are described in :mod:`celery_dlock.zookeeper.lock`, a lease's validity in
:mod:`celery_dlock.zookeeper.lease`; how the session's states map onto a
lease's validity in :mod:`celery_dlock.zookeeper.session`; the URL in
:mod:`celery_dlock.zookeeper.url`.
"""

from __future__ import annotations

from celery_dlock.zookeeper.lease import ZkLease
from celery_dlock.zookeeper.lock import ZooKeeperBackend
from celery_dlock.zookeeper.session import close_all
from celery_dlock.zookeeper.url import ZkUrl, is_zookeeper, parse

__all__ = ["ZkLease", "ZkUrl", "ZooKeeperBackend", "close_all", "is_zookeeper", "parse"]
