"""Which app's copy of an enqueue-time task checks a message sent by name.

A message published without ``SingletonTask.apply_async`` (``send_task`` by name, a beat process
that did not import the task) is given its queued lock in ``before_task_publish``
(:func:`celery_dlock.celery.enqueue.lock_unlabelled`), with the settings of the app that sends
it. Each app that binds an enqueue-time task registers here (``SingletonTask.bind``); the
receiver asks :func:`enqueue_app` which one sends the message.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

# The task's logger: these lines are about its publishes (docs/operations.md lists it).
log = logging.getLogger("celery_dlock.task")


#: Enqueue-time singleton task name -> the apps that registered it (SingletonTask.bind), in
#: order. Celery copies a shared task into every app finalized later, each copy with its app's
#: settings: a message sent by name is checked with the sending app's copy.
_enqueue_owners: dict[str, list[weakref.ref[Any]]] = {}
#: Task names whose message by name could not be matched to one app (warned once each).
_ambiguous_warned: set[str] = set()


def register_enqueue_task(name: str, app: Any) -> None:
    """Note that ``app`` has enqueue-time task ``name`` (its messages sent by name are locked)."""
    owners = [ref for ref in _enqueue_owners.get(name, ()) if ref() is not None]
    if not any(ref() is app for ref in owners):
        owners.append(weakref.ref(app))
    _enqueue_owners[name] = owners


def enqueue_apps(name: Any) -> list[Any]:
    """The live apps that registered enqueue-time task ``name``, in order."""
    refs = _enqueue_owners.get(name, ()) if isinstance(name, str) else ()
    return [app for app in (ref() for ref in refs) if app is not None]


def enqueue_app(name: Any, reply_to: Any = None) -> Any:
    """The app whose enqueue-time task ``name`` checks a message sent by name, or None.

    With one app registering ``name``, that app. With several, the one sending: Celery's
    ``send_task`` sets the message's ``reply_to`` to the sending app's ``thread_oid`` (per app
    and thread), unless the caller gave one. When none of them matches, the message cannot be
    told apart without guessing: None (published without its queued lock), with a warning.
    """
    apps = enqueue_apps(name)
    if len(apps) <= 1:
        return apps[0] if apps else None
    if reply_to:
        for app in apps:
            try:
                if app.thread_oid == reply_to:
                    return app
            except Exception:  # not a Celery app after all: cannot be the sender
                continue
    if name not in _ambiguous_warned:
        _ambiguous_warned.add(name)
        log.warning(
            "task %s sent by name (send_task) is registered with lock_on='enqueue' by %d "
            "Celery apps in this process (%s), and the message does not say which one sends "
            "it: published without its queued lock (the execution-time lock still keeps runs "
            "apart). Send it from one of these apps without a reply_to of your own, or call "
            "the task itself (app.tasks[name].apply_async) instead of send_task.",
            name,
            len(apps),
            ", ".join(repr(app) for app in apps),
        )
    return None
