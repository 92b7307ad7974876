"""What the demo measures: every execution's start and end, and every duplicate turned away.

Not part of the pattern a user copies; the tasks call it so the demo can count overlaps. A
SQLite file in WAL mode, written by every worker process; an execution whose process was
killed has a start and no end.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS executions (
    id       INTEGER PRIMARY KEY,
    task     TEXT NOT NULL,
    key      TEXT NOT NULL,
    pid      INTEGER NOT NULL,
    worker   INTEGER NOT NULL,     -- the worker's main process (the pool child's parent)
    token    INTEGER,
    started  REAL NOT NULL,
    ended    REAL,
    outcome  TEXT
);
CREATE TABLE IF NOT EXISTS events (
    kind     TEXT NOT NULL,        -- drop | requeue | wait | raise | pausing | lost
    task     TEXT NOT NULL,
    key      TEXT NOT NULL,
    pid      INTEGER NOT NULL,
    at       REAL NOT NULL
);
"""


class Journal:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._local = threading.local()

    @property
    def conn(self) -> sqlite3.Connection:
        # One connection per thread (the lock_lost signal comes from the watchdog thread) and
        # per process (a pool child must not use its parent's).
        local = self._local
        if getattr(local, "pid", None) != os.getpid():
            local.conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            local.conn.execute("PRAGMA journal_mode=WAL")
            local.pid = os.getpid()
        conn: sqlite3.Connection = local.conn
        return conn

    def create(self) -> None:
        self.conn.executescript(SCHEMA)

    def started(self, task: str, key: str, token: int | None) -> int:
        cursor = self.conn.execute(
            "INSERT INTO executions (task, key, pid, worker, token, started) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (task, key, os.getpid(), os.getppid(), token, time.time()),
        )
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    def ended(self, execution: int, outcome: str) -> None:
        self.conn.execute(
            "UPDATE executions SET ended = ?, outcome = ? WHERE id = ?",
            (time.time(), outcome, execution),
        )

    def event(self, kind: str, task: str, key: str) -> None:
        self.conn.execute(
            "INSERT INTO events (kind, task, key, pid, at) VALUES (?, ?, ?, ?, ?)",
            (kind, task, key, os.getpid(), time.time()),
        )

    def executions(self) -> list[dict[str, Any]]:
        self.conn.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in self.conn.execute("SELECT * FROM executions ORDER BY id")]
        finally:
            self.conn.row_factory = None

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        self.conn.row_factory = sqlite3.Row
        try:
            rows = self.conn.execute("SELECT * FROM events ORDER BY at")
            return [dict(r) for r in rows if kind is None or r["kind"] == kind]
        finally:
            self.conn.row_factory = None
