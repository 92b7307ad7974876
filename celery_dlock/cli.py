"""``celery -A proj dlock ...``: see, and fix, the locks a Celery app holds.

Registered as a Celery sub-command through the ``celery.commands`` entry point, so it reads
the app's ``dlock_*`` settings (single Redis or Redlock) like the workers do::

    celery -A proj dlock list [--prefix meta:] [--json]
    celery -A proj dlock show KEY [--json]
    celery -A proj dlock release KEY [--yes] [--json]
    celery -A proj dlock purge PREFIX [--yes] [--json]

``release`` does not merely delete the key: it marks the holder's acquisition revoked, so its
next renewal reports the lease lost (and a task using ``on_lock_lost="raise"`` is stopped),
and moves the fencing counter on, so the revoked holder's token is stale at once. Passwords in
URLs are never printed.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

import click
from celery.bin.base import CeleryCommand, handle_preload_options

from celery_dlock.endpoints import redact
from celery_dlock.errors import ConfigError, LockUnavailable
from celery_dlock.redlock import LockInfo, LockManager
from celery_dlock.registry import manager_for

F = TypeVar("F", bound=Callable[..., Any])


def _plain_errors(command: F) -> F:
    """Unreachable nodes and bad settings as one ``Error: ...`` line (the message names each
    node's URL, password hidden, and the fix), not a traceback."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (LockUnavailable, ConfigError) as exc:
            raise click.ClickException(str(exc)) from exc

    return run  # type: ignore[return-value]


def _manager(ctx: click.Context) -> LockManager:
    return manager_for(ctx.obj.app)


def _row(info: LockInfo, now: float) -> dict[str, Any]:
    holder = info.holder
    return {
        "key": info.key,
        "task": holder.task if holder else None,
        "task_id": holder.holder if holder else None,
        "host": holder.host if holder else None,
        "pid": holder.pid if holder else None,
        "queued": holder.queued if holder else None,
        "age": round(now - holder.since, 3) if holder else None,
        "ttl_left": None if info.ttl_left is None else round(info.ttl_left, 3),
        "fence": holder.fence if holder else info.fence,
    }


def _print_table(ctx: click.Context, rows: list[dict[str, Any]]) -> None:
    if not rows:
        ctx.obj.echo("no locks held")
        return
    columns = ("key", "task", "task_id", "host", "pid", "age", "ttl_left", "fence")
    shown = [[("-" if r[c] is None else str(r[c])) for c in columns] for r in rows]
    widths = [max(len(c), *(len(s[i]) for s in shown)) for i, c in enumerate(columns)]
    ctx.obj.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for line in shown:
        ctx.obj.echo("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)))


def _where(manager: LockManager) -> str:
    urls = [redact(node.url) for node in manager.nodes]
    return urls[0] if len(urls) == 1 else f"Redlock over {len(urls)} nodes: {', '.join(urls)}"


@click.group(name="dlock")
@click.pass_context
@handle_preload_options
def dlock(ctx: click.Context) -> None:
    """See and fix celery_dlock locks (single Redis or Redlock, from the app's settings)."""


@dlock.command(name="list", cls=CeleryCommand)
@click.option("--prefix", default="", help="only keys that start with this")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per line")
@click.pass_context
@_plain_errors
def list_(ctx: click.Context, prefix: str, as_json: bool) -> None:
    """List held locks: key, task, holder, age, time left, fencing token."""
    manager = _manager(ctx)
    now = time.time()
    rows = [_row(info, now) for info in manager.locks(prefix) if info.holder is not None]
    if as_json:
        for row in rows:
            ctx.obj.echo(json.dumps(row))
        return
    ctx.obj.echo(f"locks on {_where(manager)}:")
    _print_table(ctx, rows)


@dlock.command(name="show", cls=CeleryCommand)
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.pass_context
@_plain_errors
def show(ctx: click.Context, key: str, as_json: bool) -> None:
    """Show one lock."""
    manager = _manager(ctx)
    info = manager.inspect(key)
    row = _row(info, time.time())
    if as_json:
        ctx.obj.echo(json.dumps({**row, "held": info.holder is not None}))
        return
    if info.holder is None:
        ctx.obj.echo(f"{key!r} is not held (fencing counter {info.fence})")
        return
    for name, value in row.items():
        ctx.obj.echo(f"{name:9} {'-' if value is None else value}")


def _confirm(ctx: click.Context, question: str, yes: bool) -> None:
    if not yes and not click.confirm(question, default=False):
        raise click.Abort()


@dlock.command(name="release", cls=CeleryCommand)
@click.argument("key")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.pass_context
@_plain_errors
def release(ctx: click.Context, key: str, yes: bool, as_json: bool) -> None:
    """Force-release a lock: its holder learns at its next renewal that it lost it."""
    manager = _manager(ctx)
    info = manager.inspect(key)
    if info.holder is None:
        if as_json:
            ctx.obj.echo(json.dumps({"key": key, "released": False, "held": False}))
        else:
            ctx.obj.echo(f"{key!r} is not held; nothing to release")
        return
    _confirm(ctx, f"Release {key!r}, held by {info.holder.describe()}?", yes)
    released = manager.force_release(key, info.holder)
    if as_json:
        ctx.obj.echo(json.dumps({"key": key, "released": released, "held": True}))
    elif released:
        ctx.obj.echo(f"released {key!r}; its holder is told at its next renewal")
    else:
        ctx.obj.echo(f"{key!r} changed hands meanwhile; nothing released")
    if not released:
        ctx.exit(1)


@dlock.command(name="purge", cls=CeleryCommand)
@click.argument("prefix")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.pass_context
@_plain_errors
def purge(ctx: click.Context, prefix: str, yes: bool, as_json: bool) -> None:
    """Force-release every lock whose key starts with PREFIX."""
    if not prefix:
        raise click.BadParameter("give a non-empty prefix (every key starts with '')", ctx)
    manager = _manager(ctx)
    held = [info for info in manager.locks(prefix) if info.holder is not None]
    if not held:
        if as_json:
            ctx.obj.echo(json.dumps({"prefix": prefix, "released": []}))
        else:
            ctx.obj.echo(f"no locks held under {prefix!r}")
        return
    _confirm(ctx, f"Release {len(held)} lock(s) under {prefix!r}?", yes)
    released = [
        info.key
        for info in held
        if info.holder is not None and manager.force_release(info.key, info.holder)
    ]
    if as_json:
        ctx.obj.echo(json.dumps({"prefix": prefix, "released": released}))
    else:
        ctx.obj.echo(f"released {len(released)} of {len(held)} lock(s) under {prefix!r}")
