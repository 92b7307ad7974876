"""``celery -A proj dlock ...``: see, and fix, the locks a Celery app holds.

Registered as a Celery sub-command through the ``celery.commands`` entry point, so it reads
the app's ``dlock_*`` settings (single Redis, Redlock or ZooKeeper) like the workers do::

    celery -A proj dlock list [--prefix meta:] [--json]
    celery -A proj dlock show KEY [--json]
    celery -A proj dlock release KEY [--yes] [--json]
    celery -A proj dlock purge PREFIX [--queued] [--yes] [--json]
    celery -A proj dlock check [--no-reach]

Each is built on the function of the same name in :mod:`celery_dlock.ops.admin`, which does the
same from Python. ``show`` exits with status 1 when the lock is free (as ``test -e`` does for
a file) and 2 when it cannot tell (nodes unreachable, settings wrong), ``check`` with 1 when it
found a problem.

``release`` does not merely delete the key: it marks the holder's acquisition revoked, so its
next renewal reports the lease lost (and a task using ``on_lock_lost="raise"`` is stopped),
and moves the fencing counter on, so the revoked holder's token is stale at once. Passwords in
URLs are never printed, and keys and holder fields read from the lock store are printed with
control characters escaped (:func:`printable`): the store is shared, its contents untrusted.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click
from celery.bin.base import CeleryCommand, handle_preload_options

from celery_dlock.core.config import broker_url
from celery_dlock.core.errors import ConfigError, LockUnavailable
from celery_dlock.core.registry import backend_for
from celery_dlock.ops import admin

if TYPE_CHECKING:
    pass

F = TypeVar("F", bound=Callable[..., Any])


class _Unknown(click.ClickException):
    """``show`` could not read the lock: status 2, as grep's for an error, since its 1 means
    "free" and a script must not take an outage for a free lock."""

    exit_code = 2


def _errors_as(failed: type[click.ClickException]) -> Callable[[F], F]:
    """Unreachable nodes and bad settings as one ``Error: ...`` line (the message names each
    node's URL, password hidden, and the fix), not a traceback; the exit status ``failed``'s."""

    def decorate(command: F) -> F:
        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return command(*args, **kwargs)
            except (LockUnavailable, ConfigError) as exc:
                raise failed(printable(str(exc))) from exc

        return run  # type: ignore[return-value]

    return decorate


_plain_errors = _errors_as(click.ClickException)


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters (newline, ESC, ...), other
    non-printable ones (bidi overrides, lone surrogates), those drawn as nothing (variation
    selectors, Hangul fillers: ``a\\u034fb`` is not ``ab``) and the backslash escaped as Python
    writes them (``\\n``, ``\\x1b``, ``\\u202e``, ``\\\\``), so a key or holder field read from the
    lock store cannot forge a table row or send the terminal escape sequences. Two different
    texts stay different."""
    if text.isprintable() and "\\" not in text and not _INVISIBLE.search(text):
        return text
    return "".join(_escaped(c) if _shown_escaped(c) else c for c in text)


#: Characters Unicode draws as nothing (Default_Ignorable_Code_Point) that Python calls
#: printable: a combining grapheme joiner, Khmer and Mongolian invisible marks, Hangul
#: fillers, variation selectors. Shown raw, ``a\u034fb`` would look like ``ab``.
_INVISIBLE = re.compile(
    "[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u3164\ufe00-\ufe0f\uffa0\U000e0000-\U000e0fff]"
)


def _shown_escaped(char: str) -> bool:
    return not char.isprintable() or char == "\\" or _INVISIBLE.match(char) is not None


def _escaped(char: str) -> str:
    if char == "\\":
        return "\\\\"
    text = repr(char)[1:-1]
    if text.startswith("\\"):
        return text
    return f"\\U{ord(char):08x}" if ord(char) > 0xFFFF else f"\\u{ord(char):04x}"


def _app(ctx: click.Context) -> Any:
    """The app of ``-A``; a usage error when none was given and nothing else names where the
    locks are (Celery would hand over its default app, whose broker is unset)."""
    app = ctx.obj.app
    if not ctx.find_root().params.get("app") and not (
        app.conf.get("dlock_urls") or broker_url(app.conf)
    ):
        raise click.UsageError(
            "no Celery app given: pass -A/--app with the module of your app, as for the worker "
            "(celery -A proj dlock ...), so that its dlock_urls (or broker) are used."
        )
    return app


def _print_table(ctx: click.Context, rows: list[dict[str, Any]]) -> None:
    if not rows:
        ctx.obj.echo("no locks held")
        return
    columns = ("key", "state", "task", "task_id", "host", "pid", "age", "ttl_left", "fence")
    shown = [[("-" if r[c] is None else printable(str(r[c]))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(s[i]) for s in shown)) for i, c in enumerate(columns)]
    ctx.obj.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for line in shown:
        ctx.obj.echo("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)))


#: What a held lock's missing ``ttl_left`` means where locks do not expire (ZooKeeper).
NO_TTL = "no expiry: held for as long as its holder's ZooKeeper session lives"


@click.group(name="dlock")
@click.pass_context
@handle_preload_options
def dlock(ctx: click.Context) -> None:
    """See and fix celery_dlock locks (single Redis, Redlock or ZooKeeper, from the app's
    settings)."""


@dlock.command(name="list", cls=CeleryCommand)
@click.option("--prefix", default="", help="only keys that start with this")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per line")
@click.pass_context
@_plain_errors
def list_(ctx: click.Context, prefix: str, as_json: bool) -> None:
    """List held locks: key, state (queued, running, held), task, holder, age, time left,
    fencing token. A queued lock's host and pid are its publisher's."""
    now = time.time()
    rows = [info.as_dict(now) for info in admin.locks(_app(ctx), prefix)]
    if as_json:
        for row in rows:
            ctx.obj.echo(json.dumps(row))
        return
    backend = backend_for(_app(ctx))
    ctx.obj.echo(f"locks on {printable(backend.describe())}:")
    _print_table(ctx, rows)
    if rows and not backend.expires:
        ctx.obj.echo(f"ttl_left -: {NO_TTL}")
    for row in rows:
        if row.get("note"):
            ctx.obj.echo(printable(f"{row['key']}: {row['note']}"))


@dlock.command(name="show", cls=CeleryCommand)
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.pass_context
@_errors_as(_Unknown)
def show(ctx: click.Context, key: str, as_json: bool) -> None:
    """Show one lock."""
    info = admin.show(_app(ctx), key)
    row = info.as_dict()
    if as_json:
        ctx.obj.echo(json.dumps(row))
        if info.holder is None:
            ctx.exit(1)
        return
    backend = backend_for(_app(ctx))
    if info.holder is None:
        if info.note is not None:
            ctx.obj.echo(printable(f"{key!r} is {info.note}"))
        elif not backend.keeps_free_fence:
            ctx.obj.echo(f"{key!r} is not held")
        elif info.fence is None:
            ctx.obj.echo(f"{key!r} is not held, and no fencing token was ever issued for it")
        else:
            ctx.obj.echo(f"{key!r} is not held; the last fencing token issued was {info.fence}")
        ctx.exit(1)  # like `test -e`: a script can tell a held lock from a free one
    for name, value in row.items():
        if name == "ttl_left" and value is None and not backend.expires:
            ctx.obj.echo(f"{name:9} - ({NO_TTL})")
        elif name != "held":
            ctx.obj.echo(f"{name:9} {'-' if value is None else printable(str(value))}")


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
    info = admin.show(_app(ctx), key)
    if info.holder is None:
        if as_json:
            ctx.obj.echo(json.dumps({"key": key, "released": False, "held": False}))
        else:
            ctx.obj.echo(printable(f"{key!r} is {info.note or 'not held'}; nothing to release"))
        return
    _confirm(ctx, printable(f"Release {key!r}, held by {info.holder.describe()}?"), yes)
    # Only the acquisition that was shown: one taken since then is not released unasked.
    released = admin.release(_app(ctx), key, holder=info.holder)
    if as_json:
        ctx.obj.echo(json.dumps({"key": key, "released": released, "held": True}))
    elif released and info.holder.queued:
        ctx.obj.echo(
            printable(
                f"released {key!r}, the queued lock of task {info.holder.task_id} (no execution "
                "holds it: nobody to tell). If that message is still in a queue it runs when a "
                "worker takes it, unless a later call holds the key by then (it is then dropped, "
                "its result naming that call)"
            )
        )
    elif released and backend_for(_app(ctx)).release_seen_at_once:
        ctx.obj.echo(
            printable(f"released {key!r}; its holder is told at once (it watches its lock node)")
        )
    elif released:
        ctx.obj.echo(printable(f"released {key!r}; its holder is told at its next renewal"))
    else:
        ctx.obj.echo(printable(f"{key!r} changed hands meanwhile; nothing released"))
    if not released:
        ctx.exit(1)


@dlock.command(name="purge", cls=CeleryCommand)
@click.argument("prefix")
@click.option(
    "--queued",
    is_flag=True,
    help="only queued locks (messages not yet running), as after `celery purge`",
)
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.pass_context
@_plain_errors
def purge(ctx: click.Context, prefix: str, queued: bool, yes: bool, as_json: bool) -> None:
    """Force-release every lock whose key starts with PREFIX (with --queued, only the locks of
    queued messages: a running task keeps its key)."""
    if not prefix:
        raise click.BadParameter("give a non-empty prefix (every key starts with '')", ctx)
    held = [info for info in admin.locks(_app(ctx), prefix) if info.holder is not None]
    if queued:
        held = [info for info in held if info.state == "queued"]
    what = "queued lock(s)" if queued else "lock(s)"
    if not held:
        if as_json:
            ctx.obj.echo(json.dumps({"prefix": prefix, "released": []}))
        else:
            ctx.obj.echo(f"no {what} held under {prefix!r}")
        return
    _confirm(ctx, f"Release {len(held)} {what} under {prefix!r}?", yes)
    # Only the acquisitions that were listed: one taken since then is not released unasked.
    released = [info.key for info in held if admin.release(_app(ctx), info.key, holder=info.holder)]
    if as_json:
        ctx.obj.echo(json.dumps({"prefix": prefix, "released": released}))
    else:
        ctx.obj.echo(f"released {len(released)} of {len(held)} {what} under {prefix!r}")


@dlock.command(name="check", cls=CeleryCommand)
@click.option("--no-reach", is_flag=True, help="do not contact the lock nodes")
@click.pass_context
def check(ctx: click.Context, no_reach: bool) -> None:
    """Check the app: every SingletonTask's options, the dlock settings, the lock nodes.

    Exits 1 on any problem, so a deploy or CI step can run it before starting workers.
    """
    report = admin.check(_app(ctx), reach=not no_reach)
    if report.tasks:
        ctx.obj.echo(f"{len(report.tasks)} SingletonTask(s): {', '.join(report.tasks)}")
    for url, error in report.nodes:
        state = "not contacted" if no_reach else ("ok" if error is None else error)
        ctx.obj.echo(printable(f"lock node {url}: {state}"))
    if len(report.nodes) > 1 and not no_reach:
        answered = sum(1 for _, error in report.nodes if error is None)
        need = len(report.nodes) // 2 + 1
        verdict = "locks work" if report.quorum_reached else "locks are refused"
        ctx.obj.echo(f"{answered} of {len(report.nodes)} nodes answered, {need} needed: {verdict}")
    for warning in report.warnings:
        ctx.obj.echo(printable(f"warning: {warning}"), err=True)
    for problem in report.problems:
        ctx.obj.echo(printable(f"problem: {problem}"), err=True)
    if report.ok:
        ctx.obj.echo("ok")
    else:
        ctx.exit(1)
