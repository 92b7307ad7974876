"""The metadata table of a data collector, with fenced writes (a fencing-token check).

One row per collection job: which source and entity, the time window to collect, its status,
how many attempts it took, and the fencing token of the last execution that claimed it.
Assignment reads and writes the rows of one (source, entity): run it under a lock keyed by
both, or two workers take the same job. Results are written with the claimer's token; the
table refuses a token older than the one it holds, so a writer that lost its lock while paused
cannot overwrite the work of the one that took over.

SQLite by default (a file shared by every worker process on the host); the SQL is plain enough
for any database.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id        INTEGER PRIMARY KEY,
    source    TEXT NOT NULL,
    entity    TEXT NOT NULL,
    window    TEXT NOT NULL,              -- the time window to collect, e.g. "2026-11-22T10"
    status    TEXT NOT NULL,              -- running | done | failed
    attempts  INTEGER NOT NULL DEFAULT 1,
    fence     INTEGER NOT NULL,           -- token of the execution that last claimed the row
    items     INTEGER,
    updated   REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_segment ON jobs (source, entity, window);
CREATE TABLE IF NOT EXISTS writes (      -- every result write, accepted or not
    job       INTEGER NOT NULL,
    token     INTEGER NOT NULL,
    stored    INTEGER NOT NULL,           -- the row's fence when the write came
    accepted  INTEGER NOT NULL,
    at        REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS sequence (n INTEGER PRIMARY KEY AUTOINCREMENT);
"""


@dataclass(frozen=True)
class Job:
    id: int
    source: str
    entity: str
    window: str
    attempts: int
    fence: int


def connect(path: str | Path) -> sqlite3.Connection:
    """A connection in autocommit mode; transactions are explicit (``BEGIN IMMEDIATE``)."""
    conn = sqlite3.connect(str(path), timeout=30, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
    conn.execute("PRAGMA busy_timeout=30000")
    return conn


def create(path: str | Path) -> None:
    with connect(path) as conn:
        conn.executescript(SCHEMA)


def next_token(conn: sqlite3.Connection) -> int:
    """A token from the database's own sequence, for code that runs without a lock."""
    cursor = conn.execute("INSERT INTO sequence DEFAULT VALUES")
    assert cursor.lastrowid is not None
    return cursor.lastrowid


def assign(
    conn: sqlite3.Connection, source: str, entity: str, window: str, token: int
) -> Job | None:
    """Claim the job for one window: take it over if an earlier attempt failed or died, create
    it if there is none; None if it is already done.

    Safe only under the (source, entity) lock: a row found ``running`` is taken over because
    whoever ran it no longer holds the lock. The read and the write are separate statements
    on purpose — that is the read-modify-write the lock protects.
    """
    row = conn.execute(
        "SELECT id, status, attempts FROM jobs WHERE source = ? AND entity = ? AND window = ? "
        "ORDER BY id DESC LIMIT 1",
        (source, entity, window),
    ).fetchone()
    now = time.time()
    if row is None:
        cursor = conn.execute(
            "INSERT INTO jobs (source, entity, window, status, fence, updated) "
            "VALUES (?, ?, ?, 'running', ?, ?)",
            (source, entity, window, token, now),
        )
        assert cursor.lastrowid is not None
        return Job(cursor.lastrowid, source, entity, window, 1, token)
    job_id, status, attempts = row
    if status == "done":
        return None
    conn.execute(
        "UPDATE jobs SET status = 'running', attempts = attempts + 1, fence = ?, updated = ? "
        "WHERE id = ?",
        (token, now, job_id),
    )
    return Job(job_id, source, entity, window, attempts + 1, token)


def finish(conn: sqlite3.Connection, job: Job, status: str, items: int, *, fenced: bool) -> bool:
    """Write a job's result with the claimer's token; False if the write was refused.

    ``fenced=True`` is a fencing-token check: the row takes the write only if the token is at
    least the one it holds, in one statement. ``fenced=False`` is what code without fencing
    does; the write is recorded either way, so stale writes that got through can be counted.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        (stored,) = conn.execute("SELECT fence FROM jobs WHERE id = ?", (job.id,)).fetchone()
        guard = " AND fence <= ?" if fenced else ""
        args: tuple[object, ...] = (status, items, job.fence, time.time(), job.id)
        cursor = conn.execute(
            f"UPDATE jobs SET status = ?, items = ?, fence = ?, updated = ? WHERE id = ?{guard}",
            (*args, job.fence) if fenced else args,
        )
        accepted = cursor.rowcount == 1
        conn.execute(
            "INSERT INTO writes (job, token, stored, accepted, at) VALUES (?, ?, ?, ?, ?)",
            (job.id, job.fence, stored, int(accepted), time.time()),
        )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return accepted


@dataclass(frozen=True)
class WriteCounts:
    accepted: int
    stale_accepted: int  # token older than the row's: a late writer overwrote newer work
    stale_rejected: int  # the fence refused it
    duplicate_jobs: int  # windows with more than one row: two workers created the same job


def counts(conn: sqlite3.Connection) -> WriteCounts:
    accepted, stale_accepted, rejected = conn.execute(
        "SELECT COALESCE(SUM(accepted), 0), COALESCE(SUM(accepted AND token < stored), 0), "
        "COALESCE(SUM(NOT accepted), 0) FROM writes"
    ).fetchone()
    duplicates = conn.execute(
        "SELECT COUNT(*) FROM (SELECT 1 FROM jobs GROUP BY source, entity, window "
        "HAVING COUNT(*) > 1)"
    ).fetchone()[0]
    return WriteCounts(accepted, stale_accepted, rejected, duplicates)
