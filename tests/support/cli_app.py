"""A Celery app for the operator command's tests: ``celery -A tests.support.cli_app dlock ...``."""

from __future__ import annotations

import os

from celery import Celery

from celery_dlock import SingletonTask

app = Celery("cli_app", broker="memory://", set_as_current=False)
app.conf.dlock_urls = os.environ.get("DLOCK_TEST_LOCK_URLS", "redis://127.0.0.1:6379/0").split(",")
app.conf.dlock_ttl = 5


@app.task(base=SingletonTask, name="cli_app.replicate")
def replicate() -> None:
    """Its name shows in the listing of the locks it holds."""
