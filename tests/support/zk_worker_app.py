"""``tests.support.worker_app`` for a worker whose locks are on ZooKeeper: importing the backend
package registers the ``zookeeper://`` scheme (until config.BACKENDS lists it)."""

from __future__ import annotations

import celery_dlock.backends.zookeeper  # noqa: F401  (registers the scheme)
from tests.support.worker_app import app

__all__ = ["app"]
