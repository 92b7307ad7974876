"""The example's Celery app. Workers and beat run it as ``celery -A example_project.celery_app``.

Configured from environment variables, which the demo sets for the processes it starts:

``EXAMPLE_BROKER_URL``   the broker (Redis)
``EXAMPLE_DLOCK_URLS``   comma-separated lock servers: one URL, or three or more for Redlock
``EXAMPLE_DIR``          where the metadata tables and the demo's journals live
``EXAMPLE_API_URL``      the rate-limited external API
``EXAMPLE_QUEUE``        the queue to use (the demo picks one per run)
``EXAMPLE_BEAT``         which replication task beat schedules: ``plain`` or ``dlock``
"""

from __future__ import annotations

import os

from celery import Celery

app = Celery("example_project", include=["example_project.tasks"])
app.conf.update(
    broker_url=os.environ.get("EXAMPLE_BROKER_URL", "redis://127.0.0.1:6379/0"),
    dlock_urls=os.environ.get("EXAMPLE_DLOCK_URLS", "redis://127.0.0.1:6379/0").split(","),
    dlock_prefix=os.environ.get("EXAMPLE_PREFIX", "example"),
    task_default_queue=os.environ.get("EXAMPLE_QUEUE", "example"),
    task_ignore_result=True,  # the demo reads its journal, not results
    worker_prefetch_multiplier=1,  # a worker holds no more messages than it can run
    broker_connection_retry_on_startup=True,
    beat_max_loop_interval=1,
)

# Replication runs every second; each run takes longer than that, so without a lock runs
# pile up on each other.
REPLICATION_EVERY = float(os.environ.get("EXAMPLE_REPLICATION_EVERY", "1.0"))
if os.environ.get("EXAMPLE_BEAT"):
    replicate = "replicate" if os.environ["EXAMPLE_BEAT"] == "dlock" else "replicate_plain"
    app.conf.beat_schedule = {
        "replication": {
            "task": f"example_project.tasks.{replicate}",
            "schedule": REPLICATION_EVERY,
        }
    }
