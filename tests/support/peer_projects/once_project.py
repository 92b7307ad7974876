"""celery-once's README, as a project: the code of its examples and its settings, run by a real
worker with ``from celery_once import ...`` changed to ``celery_dlock.compat``.

Upstream: https://github.com/cameronmaske/celery-once/blob/4f68b6b3c8503b9360179a246521b07315cdf577/README.rst
(Usage, graceful, keys, timeout, unlock_before_run, Redis Backend). Changed for the test run,
and only this: the URLs come from the environment (the README's broker is AMQP; a result
backend is added so the test can read results), every sleep is multiplied by ``SCALE``, and the
README's several tasks named ``slow_task``/``slow_add`` get distinct names.
"""

import os
from time import sleep

from celery import Celery

from celery_dlock.compat import QueueOnce  # was: from celery_once import QueueOnce

SCALE = float(os.environ.get("PEER_README_SCALE", "1"))

celery = Celery(
    "tasks",
    broker=os.environ.get("PEER_BROKER", "amqp://guest@localhost//"),
    backend=os.environ.get("PEER_BACKEND"),
)
celery.conf.ONCE = {
    "backend": "celery_once.backends.Redis",
    "settings": {
        "url": os.environ.get("PEER_LOCKS", "redis://localhost:6379/0"),
        "default_timeout": 60 * 60,
    },
}


@celery.task(base=QueueOnce)
def slow_task():
    sleep(30 * SCALE)
    return "Done!"


@celery.task(base=QueueOnce, once={"graceful": True})
def slow_task_graceful():
    sleep(30 * SCALE)
    return "Done!"


@celery.task(base=QueueOnce)
def slow_add(a, b):
    sleep(30 * SCALE)
    return a + b


@celery.task(base=QueueOnce, once={"keys": ["a"]})
def slow_add_on_a(a, b):
    sleep(30 * SCALE)
    return a + b


@celery.task(base=QueueOnce, once={"keys": []})
def slow_add_any(a, b):
    sleep(30 * SCALE)
    return a + b


@celery.task(base=QueueOnce, once={"timeout": 60 * 60 * 10})
def long_running_task():
    sleep(60 * 60 * 3 * SCALE)


@celery.task(base=QueueOnce, once={"unlock_before_run": True})
def slow_task_unlocked():
    sleep(30 * SCALE)
    return "Done!"
