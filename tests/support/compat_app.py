"""The Celery app of the compat tests: tasks on ``celery_dlock.compat.Singleton`` and
``QueueOnce``, configured only with the peers' own settings (``singleton_backend_url``,
``ONCE``), run by a real ``celery worker`` (tests/support/compat_fixtures.py).

The tasks are the ones the peers' test suites define (tests/compat/test_compat_singleton_upstream.py
and tests/compat/test_compat_once_upstream.py name the upstream files) and the ones of the fault
scenarios of shared/research/anchor-faults.md (``work`` and ``flaky``, as measured there).
Every body writes to the journal of tests/support/worker_app.py.
"""

from __future__ import annotations

import os
from typing import Any

from celery_dlock.compat import QueueOnce, Singleton
from tests.support.worker_app import SupportApp, _body, record

LOCKS = os.environ.get("DLOCK_TEST_LOCK_URLS", "redis://127.0.0.1:6379/2").split(",")[0]

app = SupportApp(
    "compat_app",
    broker=os.environ.get("DLOCK_TEST_BROKER", "redis://127.0.0.1:6379/0"),
    backend=os.environ.get("DLOCK_TEST_BACKEND", "redis://127.0.0.1:6379/1"),
)
app.conf.update(
    # The peers' settings only: no dlock_urls.
    singleton_backend_url=LOCKS,
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": LOCKS, "default_timeout": 60},
    },
    # Short leases, so that a crashed worker's key expires within a test's patience.
    dlock_ttl=3,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    result_expires=600,
)


class ExpectedTaskFail(Exception):
    pass


# -- celery-singleton's test tasks --------------------------------------------------------------


@app.task(shared=False, base=Singleton)
def simple_task(*args: Any) -> Any:
    return args


@app.task(shared=False, base=Singleton)
def fails(*args: Any) -> None:
    raise ExpectedTaskFail()


@app.task(shared=False, base=Singleton, raise_on_duplicate=True)
def raise_on_duplicate_task(*args: Any) -> Any:
    return args


@app.task(shared=False, base=Singleton, unique_on=["a", "c"])
def unique_on_args_task(a: int, b: int, c: int, d: int = 4) -> int:
    return a * b * c * d


@app.task(shared=False, base=Singleton, unique_on=["b", "d"])
def unique_on_kwargs_task(a: int, b: int = 2, c: int = 3, d: int = 4) -> int:
    return a * b * c * d


@app.task(shared=False, base=Singleton, unique_on=[])
def unique_on_empty_task(a: int, b: int = 2, c: int = 3, d: int = 4) -> int:
    return a * b * c * d


@app.task(shared=False, base=Singleton, unique_on="c")
def unique_on_string_task(a: int, b: int = 2, c: int = 3, d: int = 4) -> int:
    return a * b * c * d


@app.task(shared=False, base=Singleton, unique_on="d")
def unique_on_default_task(a: int, b: int = 2, c: int = 3, d: int = 4) -> int:
    return a * b * c * d


@app.task(shared=False, base=Singleton, lock_expiry=60)
def expiring_task(*args: Any) -> Any:
    return args


# -- celery-once's test tasks -------------------------------------------------------------------


@app.task(shared=False, name="example", base=QueueOnce, bind=True)
def example(self: Any, a: int = 1) -> dict[str, Any]:
    """Reports whether its key was held while it ran (upstream asserts it in the body)."""
    key = self.get_key((a,), {})
    holder = self._dlock().manager.holder(key)
    return {"a": a, "held_by_me": holder is not None and holder.task_id == self.request.id}


@app.task(
    shared=False,
    name="example_unlock_before_run",
    base=QueueOnce,
    once={"unlock_before_run": True},
    bind=True,
)
def example_unlock_before_run(self: Any, secs: float = 0.0) -> None:
    _body(self, "unlock_before_run", secs)


@app.task(shared=False, name="example_retry", base=QueueOnce, once={"keys": []}, bind=True)
def example_retry(self: Any, a: int = 0) -> int:
    record("start", name="example_retry", id=self.request.id, retries=self.request.retries)
    if a != 1:
        raise self.retry(kwargs={"a": 1}, countdown=0.2)
    return a


@app.task(shared=False, name="bound_task", bind=True, base=QueueOnce)
def bound_task(self: Any, a: int, b: int) -> int:
    return a + b


@app.task(shared=False, name="args_example", base=QueueOnce)
def args_example(a: int, b: int) -> int:
    return a + b


@app.task(shared=False, name="select_args_example", base=QueueOnce, once={"keys": ["a"]})
def select_args_example(a: int, b: int) -> int:
    return a + b


@app.task(shared=False, name="autoretry_for_example", base=QueueOnce, autoretry_for=(Exception,))
def autoretry_for_example(a: int, b: int) -> int:
    return a + b


# -- the fault scenarios' tasks (anchor-faults.md: work, flaky), once per compat class ---------


@app.task(shared=False, base=Singleton, bind=True)
def work(self: Any, a: int, b: int, secs: float) -> int:
    _body(self, f"singleton-{a}-{b}", secs)
    return a + b


@app.task(shared=False, base=Singleton, bind=True)
def flaky(self: Any, a: int, b: int) -> int:
    _body(self, f"singleton-flaky-{a}-{b}", 0.1)
    if self.request.retries == 0:
        raise self.retry(countdown=1)
    return a + b


@app.task(shared=False, base=QueueOnce, bind=True)
def once_work(self: Any, a: int, b: int, secs: float) -> int:
    _body(self, f"once-{a}-{b}", secs)
    return a + b


@app.task(shared=False, base=QueueOnce, bind=True)
def once_flaky(self: Any, a: int, b: int) -> int:
    _body(self, f"once-flaky-{a}-{b}", 0.1)
    if self.request.retries == 0:
        raise self.retry(countdown=1)
    return a + b


# -- celery-once's README "Flask Integration": a QueueOnce subclass that wraps __call__ --------

entered: list[str] = []


class ContextQueueOnce(QueueOnce):
    """README: ``class ContextQueueOnce(QueueOnce)`` entering an app context in ``__call__``
    (here a record of it: Flask is not installed)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        entered.append(self.request.id or "")
        return super().__call__(*args, **kwargs)


@app.task(shared=False, base=ContextQueueOnce, bind=True)
def sleep_task(self: Any, value: float) -> dict[str, Any]:
    _body(self, "flask-sleep", value)
    return {"in_context": self.request.id in entered, "key": self.lease.key if self.lease else None}


# -- S6: a lifetime shorter than the run (celery-singleton lock_expiry, celery-once timeout) --


@app.task(shared=False, base=Singleton, bind=True, lock_expiry=1)
def short_lived(self: Any, a: int, secs: float) -> int:
    _body(self, f"singleton-short-{a}", secs)
    return a


@app.task(shared=False, base=QueueOnce, bind=True, once={"timeout": 1})
def once_short_lived(self: Any, a: int, secs: float) -> int:
    _body(self, f"once-short-{a}", secs)
    return a


# -- a migrating team's calls (tests/compat/test_compat_migration.py) ------------------------------


@app.task(shared=False, base=Singleton, bind=True, raise_on_duplicate=True)
def raising_work(self: Any, a: int, secs: float) -> int:
    _body(self, f"singleton-raising-{a}", secs)
    return a


@app.task(shared=False)
def fan_out(name: str, a: int, secs: float) -> str:
    """A plain task that publishes a compat task, as a dispatcher (or a beat job) does: the
    compat class's exception, if any, is this task's failure."""
    if name == "once":
        return str(once_work.delay(a, a, secs).id)
    return str(raising_work.delay(a, secs).id)


@app.task(
    shared=False,
    base=Singleton,
    bind=True,
    raise_on_duplicate=True,
    autoretry_for=(ExpectedTaskFail,),
    max_retries=1,
    default_retry_delay=0.3,
)
def autoretry_raising(self: Any, a: int) -> int:
    """celery-singleton#55: autoretry_for with raise_on_duplicate (there, the retry raised
    DuplicateTaskError and the worker died)."""
    _body(self, f"singleton-autoretry-{a}", 0.1)
    if self.request.retries == 0:
        raise ExpectedTaskFail()
    return a


@app.task(shared=False, base=Singleton, bind=True, unique_on=[], raise_on_duplicate=True)
def reschedules_itself(self: Any, n: int) -> int:
    """celery-singleton#53: a task that frees its own key, queues its next run (n - 1), and
    goes on working (1.5 s for n=2: longer than the lease's renewal interval)."""
    _body(self, "singleton-reschedules", 0.1, n=n)
    if n > 0:
        self.release_lock()
        self.apply_async((n - 1,), countdown=0.2)
    _body(self, "singleton-reschedules-rest", 1.5 if n == 2 else 0.0, n=n)
    return n


# -- the peers' way to a key of one's own: overriding generate_lock / get_key -----------------


class ByAccount(Singleton):
    """celery-singleton: a custom key by overriding ``generate_lock`` (the account alone)."""

    def generate_lock(
        self, task_name: str | None, task_args: Any = None, task_kwargs: Any = None
    ) -> str:
        account = (task_kwargs or {}).get("account", (task_args or [None])[0])
        return f"account-{account}"


class OnceByAccount(QueueOnce):
    """celery-once: a custom key by overriding ``get_key``, calling ``super()``."""

    def get_key(self, args: Any = None, kwargs: Any = None) -> str:
        account = (kwargs or {}).get("account", (args or [None])[0])
        return "by-account-" + super().get_key((account, 0.0), {})


@app.task(shared=False, base=ByAccount, bind=True)
def sync_account(self: Any, account: int, secs: float) -> int:
    _body(self, f"singleton-account-{account}", secs)
    return account


@app.task(shared=False, base=OnceByAccount, bind=True)
def once_sync_account(self: Any, account: int, secs: float) -> int:
    _body(self, f"once-account-{account}", secs)
    return account


# -- Flask's ContextTask pattern on a compat class: __call__ runs self.run itself --------------


class RunsItselfSingleton(Singleton):
    """Flask's ``ContextTask`` pattern: ``return self.run(*args, **kwargs)`` inside an app
    context, not ``super().__call__``: our execution-time lock is bypassed."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


class RunsItselfQueueOnce(QueueOnce):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


@app.task(shared=False, base=RunsItselfSingleton)
def runs_itself(a: int) -> int:
    return a


@app.task(shared=False, base=RunsItselfQueueOnce)
def once_runs_itself(a: int) -> int:
    return a
