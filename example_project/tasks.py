"""The two jobs of the example, each written twice: as plain Celery tasks and with celery_dlock.

* **Replication** (an application-level lock): one pipeline that must run in one instance
  cluster-wide. Beat sends it every second; a run takes longer than that.
* **Collection** (a resource-level lock): fetch one (source, entity, window) from a
  rate-limited external API, recording the job in the metadata table. The lock is keyed by
  source and entity, so different entities run in parallel and one entity never twice.

The plain twins run the same code without a lock, which is what the demo compares.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path
from typing import Any

from celery import Task

from celery_dlock import SingletonTask, lock_contended, lock_lost
from example_project import api, metadata
from example_project.celery_app import app
from example_project.journal import Journal

REPLICATION_STEPS = 5
REPLICATION_STEP = 0.4  # seconds: a run takes 2 s, beat sends one every second
COLLECT_PAGES = 2  # API calls per collection job


def pass_dir(name: str) -> Path:
    """Each demo pass ("plain", "dlock") keeps its own metadata table and journal."""
    return Path(os.environ.get("EXAMPLE_DIR", ".")) / name


@functools.cache
def journal(name: str) -> Journal:
    return Journal(pass_dir(name) / "journal.db")


# -- replication: one instance cluster-wide -----------------------------------------------------


def replication_pipeline(step: Any = None) -> None:
    """Stand-in for a replication pipeline: a few steps, each a unit of work."""
    for _ in range(REPLICATION_STEPS):
        if step is not None:
            step()
        time.sleep(REPLICATION_STEP)


@app.task(
    base=SingletonTask,
    bind=True,
    lock_key="replication",  # one key for the whole cluster: an application-level lock
    lock_ttl=3,
    # Another worker that receives it while a run is under way drops out (the result says
    # which task holds the lock); "wait" makes it stand by instead, as the original replication
    # service does.
    on_duplicate=os.environ.get("EXAMPLE_REPLICATION_POLICY", "drop"),
    lock_wait=10,
)
def replicate(self: SingletonTask) -> None:
    assert self.lease is not None
    book = journal("dlock")
    run = book.started("replicate", "replication", self.lease.token)
    outcome = "failed"
    try:
        # ensure() before each step: a run whose lease ran out stops before doing more.
        replication_pipeline(step=self.lease.ensure)
        outcome = "ok"
    finally:
        book.ended(run, outcome)


@app.task
def replicate_plain() -> None:
    book = journal("plain")
    run = book.started("replicate", "replication", None)
    replication_pipeline()
    book.ended(run, "ok")


# -- collection: one (source, entity) at a time -------------------------------------------------


def collect_window(
    run: str, source: str, entity: str, window: str, token: int, *, fenced: bool,
    lease_check: Any = None, pause: bool = False,
) -> str:  # fmt: skip
    """Claim the job in the metadata table, fetch its pages, write the result with ``token``."""
    api_url = os.environ["EXAMPLE_API_URL"]
    conn = metadata.connect(pass_dir(run) / "metadata.db")
    try:
        job = metadata.assign(conn, source, entity, window, token)
        if job is None:
            return "already collected"
        items = 0
        for _ in range(COLLECT_PAGES):
            if lease_check is not None:
                lease_check()  # no API call on a lease that ran out
            for _attempt in range(20):
                status, body = api.call(api_url, source, entity, caller=str(os.getpid()))
                if status != 429:
                    break
                time.sleep(float(body.get("retry_after", 0.1)))  # be a polite client
            items += int(body.get("items", 0))
        if lease_check is not None:
            lease_check()  # right before the write: raises LockLost if the lease ran out
        if pause:
            # Demo only: stop this whole process here, between the check and the write, as a
            # long GC pause would. The demo resumes it after another worker took the job over.
            journal(run).event("pausing", "collect", f"{source}:{entity}")
            os.kill(os.getpid(), signal.SIGSTOP)
        accepted = metadata.finish(conn, job, "done", items, fenced=fenced)
        return "ok" if accepted else "write refused (stale token)"
    finally:
        conn.close()


@app.task(
    base=SingletonTask,
    bind=True,
    lock_key="{source}:{entity}",  # the resource: one entity of one source
    lock_ttl=2,
    on_duplicate="requeue",  # another window of a busy entity comes back later
    lock_requeue_delay=0.25,
    lock_requeue_max_delay=1.0,
    # The body checks the lease itself (ensure() before each call and before the write), and
    # the table's fence refuses a write that slips past the check; see collect_window.
    on_lock_lost="flag",
)
def collect(self: SingletonTask, source: str, entity: str, window: str, pause: bool = False) -> str:
    assert self.lease is not None
    book = journal("dlock")
    run = book.started("collect", f"{source}:{entity}", self.lease.token)
    outcome = "failed"
    try:
        outcome = collect_window(
            "dlock", source, entity, window, self.lease.token, fenced=True,
            lease_check=self.lease.ensure, pause=pause,
        )  # fmt: skip
    finally:
        book.ended(run, outcome)
    return outcome


@app.task
def collect_plain(source: str, entity: str, window: str, pause: bool = False) -> str:
    book = journal("plain")
    with metadata.connect(pass_dir("plain") / "metadata.db") as conn:
        token = metadata.next_token(conn)
    run = book.started("collect", f"{source}:{entity}", token)
    outcome = "failed"
    try:
        outcome = collect_window("plain", source, entity, window, token, fenced=False)
    finally:
        book.ended(run, outcome)
    return outcome


# -- what the demo counts -----------------------------------------------------------------------


@lock_contended.connect
def count_duplicate(sender: Task[Any, Any] | None = None, key: str = "", policy: str = "",
                    **_: Any) -> None:  # fmt: skip
    if sender is not None:
        journal("dlock").event(policy, sender.name.rsplit(".", 1)[-1], key)


@lock_lost.connect
def count_lost(sender: Task[Any, Any] | None = None, key: str = "", **_: Any) -> None:
    if sender is not None:
        journal("dlock").event("lost", sender.name.rsplit(".", 1)[-1], key)
