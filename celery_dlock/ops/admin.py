"""What an operator can do to locks, from Python: list, show, release, purge, and check an app.

``celery -A proj dlock list|show|release|purge|check`` is built on these functions. Each takes
what :func:`celery_dlock.lock` takes: a Celery app (its ``dlock_*`` settings) or a list of
Redis URLs::

    from celery_dlock import admin

    for info in admin.locks(app, prefix="meta:"):
        print(info.key, info.task_id, info.ttl_left)
    admin.release(app, "meta:github:repo-1")            # its holder is told it lost the lease
    admin.purge(app, "meta:")                           # every lock under a prefix
    problems = admin.check(app).problems                # options, settings, reachable nodes

A forced release does not merely delete the key: it marks that acquisition revoked, so the
holder's next renewal reports the lease lost (a task with ``on_lock_lost="raise"`` is
stopped), and moves the fencing counter on, so the holder's token is stale at once.

Everything here goes through :class:`celery_dlock.core.backend.Backend`: how a store lists, reads
and force-releases its keys is the backend's business (Redis:
:mod:`celery_dlock.backends.redis.inspection`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery import Celery
from celery.local import maybe_evaluate

from celery_dlock.core.config import beat_settings, check_key, quorum
from celery_dlock.core.errors import ConfigError
from celery_dlock.core.holder import Holder, LockInfo
from celery_dlock.core.registry import backend_for
from celery_dlock.core.urls import tls_warnings

if TYPE_CHECKING:
    from celery_dlock.core.backend import Backend

__all__ = ["CheckReport", "LockInfo", "check", "locks", "node_errors", "purge", "release", "show"]


def locks(app_or_urls: Any, prefix: str = "") -> list[LockInfo]:
    """Every lock held now whose key starts with ``prefix``, as a majority of nodes sees it
    (a key blocked by a value this library did not write too: its ``note`` says so).

    Raises :class:`~celery_dlock.LockUnavailable` when the nodes cannot be read.
    """
    if not isinstance(prefix, str):
        raise ConfigError(f"prefix must be a str, not {type(prefix).__name__} ({prefix!r}).")
    return [
        info
        for info in backend_for(app_or_urls).locks(prefix)
        if info.holder is not None or info.note is not None
    ]


def show(app_or_urls: Any, key: str) -> LockInfo:
    """One lock: its holder (None when free), time left and fencing counter."""
    return backend_for(app_or_urls).inspect(check_key(key))


def release(
    app_or_urls: Any, key: str, *, task_id: str | None = None, holder: Holder | None = None
) -> bool:
    """Force-release ``key``; True if it was held and a majority of nodes released it.

    With ``task_id``, only while that task holds it (celery-singleton's ``release_lock``
    for one task); False when someone else holds it, or nobody. With ``holder`` (as
    :func:`show` returned it), only that acquisition: one taken since is left alone.
    """
    backend = backend_for(app_or_urls)
    if holder is None:
        holder = backend.inspect(check_key(key)).holder
    if holder is None or (task_id is not None and holder.task_id != task_id):
        return False
    return backend.force_release(key, holder)


def purge(app_or_urls: Any, prefix: str) -> list[str]:
    """Force-release every lock whose key starts with ``prefix``; the keys released."""
    if not isinstance(prefix, str) or not prefix:
        raise ConfigError(
            f"purge needs a non-empty prefix (every key starts with ''), got {prefix!r}; "
            "to release everything, name each key prefix your tasks use."
        )
    return backend_for(app_or_urls).purge(prefix)


def node_errors(manager: Backend) -> list[tuple[str, str]]:
    """``(url, error)`` for each lock node of ``manager`` (a backend) that cannot run a lock
    script right now, password hidden; empty when every node answered."""
    return [(url, error) for url, error in manager.check() if error is not None]


@dataclass
class CheckReport:
    """What :func:`check` found: the singleton tasks, each lock node, and every problem."""

    #: Names of the app's SingletonTasks (each created, so its options were checked).
    tasks: list[str] = field(default_factory=list)
    #: ``(url, error)`` per lock node, password hidden; error is None for a node that answered.
    nodes: list[tuple[str, str | None]] = field(default_factory=list)
    #: One line per problem, each naming what to fix.
    problems: list[str] = field(default_factory=list)
    #: What works but should not stay so (TLS without verification); not a problem for ``ok``.
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def quorum_reached(self) -> bool:
        """Whether enough nodes answered for locks to work (all of them: still fine)."""
        answered = sum(1 for _, error in self.nodes if error is None)
        return bool(self.nodes) and answered >= quorum(len(self.nodes))


def check(app: Any, *, reach: bool = True) -> CheckReport:
    """Check a Celery app the way a worker meets it, before any task runs.

    Creates the app's tasks (Celery creates ``@app.task`` classes lazily, so a wrong
    ``SingletonTask`` option otherwise surfaces at the task's first use), reads the
    ``dlock_*`` settings (the beat scheduler's too), and with ``reach`` runs a lock script on
    every node. Never raises for what it finds: each problem is one line of the report, every
    wrong task among them.
    """
    if not isinstance(app, Celery):  # (hasattr(app, "tasks") would finalize it)
        raise ConfigError(
            f"check needs a Celery app, not {type(app).__name__} ({app!r}); for a list of "
            "URLs, node_errors(backend_for(urls)) says which nodes answer."
        )
    report = CheckReport()
    report.problems += _create_tasks(app)
    try:
        tasks = dict(app.tasks)  # finalizes the app (done already if the above went well)
    except ConfigError as exc:
        if str(exc) not in report.problems:
            report.problems.append(str(exc))
        tasks = dict(getattr(app, "_tasks", {}))  # those that could be created
    # SingletonTask marks its classes (compat's included), so that the operator functions
    # need not import the Celery task layer to tell them.
    singletons = sorted(
        n for n, t in tasks.items() if getattr(t, "_dlock_singleton", False) is True
    )
    report.tasks = singletons
    try:
        beat_settings(app)
        backend = backend_for(app)
        for name in singletons:
            task: Any = tasks[name]
            task._dlock()  # resolved, as its first run does
    except ConfigError as exc:
        report.problems.append(str(exc))
        return report
    report.warnings = tls_warnings(backend.settings.urls)
    if reach:
        try:
            report.nodes = backend.check()
        except ConfigError as exc:  # found on contact: two URLs reach one Redis server
            report.problems.append(str(exc))
            return report
    else:
        report.nodes = [(url, None) for url in backend.endpoints()]
    failed = {url: error for url, error in report.nodes if error is not None}
    report.problems += [
        f"cannot reach lock node {url} ({error.rstrip('.')})" for url, error in failed.items()
    ]
    return report


def _create_tasks(app: Any) -> list[str]:
    """Create the tasks an unfinalized app has pending, one by one, so that every wrong one
    is reported (finalizing stops at the first); the problems found."""
    problems: list[str] = []
    if getattr(app, "finalized", True):
        return problems
    for pending in list(getattr(app, "_pending", ())):
        try:
            maybe_evaluate(pending)
        except ConfigError as exc:
            problems.append(str(exc))
    return problems
