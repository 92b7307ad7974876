"""One lock backend per app or URL list, made on first use and shared by the process.

A backend owns the clients of one node set, so sharing it means ``lock()`` and every task
reuse the same connections. Which backend serves a URL list is the URL scheme's choice
(:func:`celery_dlock.core.urls.backend_module`); this module imports none of them. An app's
``dlock_*`` settings are read once, on first use (after the app's configuration has loaded);
:func:`forget` drops what was cached, for tests that reconfigure an app.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celery_dlock.core.config import Settings, settings_from_app
from celery_dlock.core.errors import ConfigError
from celery_dlock.core.urls import backend_module, check_urls

if TYPE_CHECKING:
    from celery_dlock.core.backend import Backend

_managers: dict[Settings, Backend] = {}
#: URL lists already checked, as given: ``lock(urls, key)`` parses and checks them once, not
#: on every call (that was about a fifth of an uncontended lock cycle).
_by_urls: dict[tuple[str, ...], Backend] = {}
#: The attribute of a Celery app that holds its backend, once its settings were read.
_ON_APP = "_celery_dlock_backend"
#: The backends of apps that refuse that attribute (no ``__dict__``, a ``__setattr__`` of their
#: own), weakly keyed as all apps' were before: only looked at when the attribute is missing.
_app_managers: weakref.WeakKeyDictionary[Any, Backend] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def manager_for_settings(settings: Settings) -> Backend:
    with _registry_lock:
        manager = _managers.get(settings)
        if manager is None:
            made: Backend = backend_module(settings.urls).make_backend(settings)
            manager = _managers[settings] = made
        return manager


def manager_for(app_or_urls: Any) -> Backend:
    """The shared backend for a Celery app (its ``dlock_*`` settings, read once) or URL list;
    a backend given is returned as it is."""
    if type(app_or_urls) is list:  # the usual URL list, already seen: one lookup
        manager = _seen(tuple(app_or_urls))
        if manager is not None:
            return manager
    else:
        # An app seen before keeps its backend on itself: one attribute read, before even
        # asking for its ``conf`` (a property). A WeakKeyDictionary builds a weakref per call.
        kept: Backend | None = getattr(app_or_urls, _ON_APP, None)
        if kept is not None:
            return kept
    if hasattr(app_or_urls, "conf"):
        return _app_manager(app_or_urls)
    if isinstance(app_or_urls, str | Sequence):
        given = (app_or_urls,) if isinstance(app_or_urls, str) else tuple(app_or_urls)
        manager = _seen(given)
        if manager is None:
            manager = manager_for_settings(Settings(urls=check_urls(app_or_urls)))
            if len(_by_urls) < 1000:  # URL lists built per call must not grow this unbounded
                _by_urls[given] = manager
        return manager
    if callable(getattr(app_or_urls, "acquire_checked", None)):  # a backend already
        backend: Backend = app_or_urls
        return backend
    raise ConfigError(
        "lock() needs a Celery app or a list of lock-store URLs as its first argument, not "
        f"{type(app_or_urls).__name__} ({app_or_urls!r})."
    )


def _seen(urls: tuple[Any, ...]) -> Backend | None:
    """The backend of a URL list checked before, as given; None if new or not hashable."""
    try:
        return _by_urls.get(urls)
    except TypeError:  # an unhashable entry: not a URL; check_urls says so
        return None


def _app_manager(app: Any) -> Backend:
    """An app's backend when its attribute is not set: kept on the app if it takes the
    attribute, else weakly keyed by it, else (neither) made from its settings on every call."""
    try:
        manager = _app_managers.get(app)
    except TypeError:  # not weakly referable (celery.current_app, a Proxy, sets the attribute)
        manager = None
    if manager is None:
        manager = manager_for_settings(settings_from_app(app))
        try:
            setattr(app, _ON_APP, manager)
        except (AttributeError, TypeError):  # slots without __dict__, a refusing __setattr__
            with contextlib.suppress(TypeError):  # nor weakly referable: settings read per call
                _app_managers[app] = manager
    return manager


#: The shared backend for a Celery app (its ``dlock_*`` settings) or URL list; a backend given
#: is returned as it is. The same function as :func:`manager_for` (no call in between).
backend_for = manager_for


def forget(app: Any) -> None:
    """Drop the manager cached for ``app`` and its tasks' resolved settings."""
    namespace = getattr(app, "__dict__", None)  # a Proxy's is its current app's
    if namespace is not None:
        namespace.pop(_ON_APP, None)
    with _registry_lock, contextlib.suppress(TypeError):  # TypeError: not weakly referable
        _app_managers.pop(app, None)
    for task in getattr(app, "_tasks", {}).values():
        task.__dict__.pop("_dlock_resolved", None)
