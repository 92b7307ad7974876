"""This process's id, kept current across ``fork()`` without a system call per check.

Connections and sessions belong to one process: each compares the pid it was made in with
:func:`pid` to notice that it is now in a forked child (a Celery prefork pool process) and must
start afresh, and a lock node or lease records it. ``os.getpid()`` is a system call, and the
lock's hot path asked for it several times per acquisition. (Background threads and thread
pools are made afresh at the fork itself instead: :class:`celery_dlock.core.background.PerProcess`.)
"""

from __future__ import annotations

import os

_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def pid() -> int:
    return _pid
