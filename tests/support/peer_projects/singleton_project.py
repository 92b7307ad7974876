"""celery-singleton's README, as a project: the code of its examples and its settings, run by a
real worker with ``from celery_singleton import ...`` changed to ``celery_dlock.compat``.

Upstream: https://github.com/steinitzu/celery-singleton/blob/4ee161853d82f71d4565be2bd7d81fc6d8bcbded/README.md
(Quick start, unique_on, raise_on_duplicate, lock_expiry, Handling deadlocks, App
Configuration). Changed for the test run, and only this: the URLs come from the environment,
every duration (sleeps, ``lock_expiry``) is multiplied by ``SCALE`` so the run is short, and
the two README tasks both named ``do_something`` get distinct names.
"""

import os
import time

from celery import Celery
from celery.signals import worker_ready

from celery_dlock.compat import Singleton, clear_locks  # was: from celery_singleton import ...

SCALE = float(os.environ.get("PEER_README_SCALE", "1"))

celery_app = Celery(
    "singleton_project",
    broker=os.environ.get("PEER_BROKER", "redis://localhost:6379/0"),
    backend=os.environ.get("PEER_BACKEND", "redis://localhost:6379/0"),
)
# App Configuration (README table)
celery_app.conf.singleton_backend_url = os.environ.get("PEER_LOCKS", "redis://localhost:6379/1")
celery_app.conf.singleton_key_prefix = "SINGLETONLOCK_"
celery_app.conf.singleton_raise_on_duplicate = False


@celery_app.task(base=Singleton)
def do_stuff(*args, **kwargs):
    time.sleep(4 * SCALE)
    return "I just woke up"


@celery_app.task(base=Singleton, unique_on=["username"])
def do_something(username, otherarg=None):
    time.sleep(5 * SCALE)


@celery_app.task(base=Singleton, raise_on_duplicate=True)
def do_something_else(username):
    time.sleep(5 * SCALE)


@celery_app.task(base=Singleton, lock_expiry=10 * SCALE)
def runs_for_12_seconds():
    time.sleep(12 * SCALE)


# Handling deadlocks
@worker_ready.connect
def unlock_all(**kwargs):
    clear_locks(celery_app)
