"""Breaks of the layering refactor (205c568..main) that a user or a deployment would meet.

The refactor promised that no public name or behaviour changed. Each test here pins one place
where that promise does not hold, comparing with what 205c568 did. Tests that need the old code
run it in a subprocess from ``git archive 205c568`` (skipped when the commit is not in the
clone); others carry what the old code wrote (pickles) as literals.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from celery_dlock import Holder, LockContended
from tests.old_tree import unpack

# What 205c568 pickled for
#   Holder(token="n1", holder="tid", host="h", pid=1, since=2.0, fence=3)
# and for LockContended("held", key="k", holder=<that holder>, retry_after=1.5), protocol 4:
# what a pickle result backend (or any cache) holds from an old worker during a rolling upgrade.
OLD_HOLDER_PICKLE = base64.b64decode(
    "gASVhgAAAAAAAACME2NlbGVyeV9kbG9jay5ob2xkZXKUjAZIb2xkZXKUk5QpgZR9lCiMBXRva2VulIwCbjGUjAZob2x"
    "kZXKUjAN0aWSUjARob3N0lIwBaJSMA3BpZJRLAYwFc2luY2WUR0AAAAAAAAAAjAVmZW5jZZRLA4wGcXVldWVklImMBH"
    "Rhc2uUTnViLg=="
)
OLD_CONTENDED_PICKLE = base64.b64decode(
    "gASVHwEAAAAAAACME2NlbGVyeV9kbG9jay5lcnJvcnOUjA1Mb2NrQ29udGVuZGVklJOUjARoZWxklH2UKIwDa2V5lIw"
    "Ba5SMBmhvbGRlcpR9lCiMBXRva2VulIwCbjGUaAeMA3RpZJSMBGhvc3SUjAFolIwDcGlklEsBjAVzaW5jZZRHQAAAAAA"
    "AAACMBWZlbmNllEsDjAZxdWV1ZWSUiYwEdGFza5ROdYwLcmV0cnlfYWZ0ZXKURz/4AAAAAAAAdYaUUpR9lChoB4wTY2"
    "VsZXJ5X2Rsb2NrLmhvbGRlcpSMBkhvbGRlcpSTlCmBlH2UKGgJaApoB2gLaAxoDWgOSwFoD0dAAAAAAAAAAGgQSwNoEY"
    "loEk51YmgTRz/4AAAAAAAAaAVoBnViLg=="
)


@pytest.fixture(scope="session")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package as of 205c568, unpacked from git (skip when the clone lacks the commit)."""
    return unpack(tmp_path_factory, "old205", "celery_dlock")


def run_with(tree: Path, code: str, stdin: bytes = b"") -> bytes:
    """Run ``code`` in a fresh interpreter importing celery_dlock from ``tree``; its stdout."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = f"import celery_dlock; assert celery_dlock.__file__.startswith({str(tree)!r})\n{code}"
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=stdin,
        env=env,
        cwd=tree,  # not the source tree: "-c" puts the working directory first on sys.path
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return done.stdout


def _holder() -> Holder:
    return Holder("n1", "tid", "h", 1, 2.0, 3)


# -- 1. pickle across versions (a pickle result backend shared by old and new workers) --------


def test_a_holder_pickled_by_the_old_version_loads_whole() -> None:
    # 205c568's Holder pickles its fields under their old names (token, holder); the new
    # Holder stores nonce/task_id and reads token/holder through properties over them, so an
    # old pickle loads into an object whose every name for the nonce raises AttributeError.
    holder = pickle.loads(OLD_HOLDER_PICKLE)
    assert holder.token == "n1"
    assert holder.holder == "tid"
    assert holder.nonce == "n1"
    assert holder.task_id == "tid"
    assert holder == _holder()


def test_a_lock_contended_pickled_by_the_old_version_loads() -> None:
    # A LockContended an old worker stored in a pickle result backend: result.get() in a new
    # client unpickles it. It now fails inside pickle.loads with AttributeError 'nonce'.
    error = pickle.loads(OLD_CONTENDED_PICKLE)
    assert isinstance(error, LockContended)
    assert error.key == "k"
    assert error.holder is not None
    assert error.holder.holder == "tid"
    assert error.holder.token == "n1"


def test_a_holder_pickles_its_state_under_the_names_older_versions_read() -> None:
    # The other direction of a rolling upgrade: what a new worker pickles must load in an old
    # client. Pickle restores a dataclass's __dict__ as it was written, so the state must keep
    # the old field names token/holder (205c568 had no other).
    state = _holder().__reduce_ex__(4)[2]
    assert set(state) == {"token", "holder", "host", "pid", "since", "fence", "queued", "task"}


def test_the_old_version_loads_a_lock_contended_the_new_version_pickled(old_tree: Path) -> None:
    error = LockContended("held", key="k", holder=_holder(), retry_after=1.5)
    out = run_with(
        old_tree,
        "import pickle, sys\n"
        "e = pickle.loads(sys.stdin.buffer.read())\n"
        "print(e.key, e.holder.holder, e.holder.token, e.retry_after)\n",
        stdin=pickle.dumps(error, protocol=4),
    )
    assert out.split() == [b"k", b"tid", b"n1", b"1.5"]


def test_the_new_version_loads_a_lock_contended_the_old_version_pickles(old_tree: Path) -> None:
    blob = run_with(
        old_tree,
        "import pickle, sys\n"
        "from celery_dlock import Holder, LockContended\n"
        "h = Holder(token='n1', holder='tid', host='h', pid=1, since=2.0, fence=3)\n"
        "e = LockContended('held', key='k', holder=h, retry_after=1.5)\n"
        "sys.stdout.buffer.write(pickle.dumps(e))\n",
    )
    error = pickle.loads(blob)
    assert (error.key, error.holder.holder, error.holder.token) == ("k", "tid", "n1")


# -- 2. Holder is a public dataclass: its dataclass surface changed -------------------------


def test_holder_dataclass_fields_keep_their_names() -> None:
    # dataclasses.asdict/fields/astuple, __match_args__: 205c568 named them token, holder, ...
    names = [f.name for f in dataclasses.fields(Holder)]
    assert names == ["token", "holder", "host", "pid", "since", "fence", "queued", "task"]
    assert dataclasses.asdict(_holder())["holder"] == "tid"


def test_dataclasses_replace_with_the_old_field_names_still_works() -> None:
    # dataclasses.replace(h, holder=...) worked on 205c568; now TypeError "got both" (and mypy
    # rejects the call in user code: "Unexpected keyword argument 'holder'").
    assert dataclasses.replace(_holder(), holder="other").holder == "other"  # type: ignore[call-arg]
    assert dataclasses.replace(_holder(), token="x").token == "x"  # type: ignore[call-arg]


def test_holder_repr_is_unchanged() -> None:
    # Logs and operators' scripts that show a Holder (and LockInfo, which embeds it) saw this.
    assert repr(_holder()) == (
        "Holder(token='n1', holder='tid', host='h', pid=1, since=2.0, fence=3, queued=False,"
        " task=None)"
    )


# -- 3. LockInfo (public: celery_dlock.LockInfo, admin.locks()/show()) moved module --------

# What 205c568 pickled for LockInfo("k", None, None, 7): the class by its module path then,
# celery_dlock.redlock.LockInfo (a task returning admin.locks() under the pickle serializer).
OLD_LOCKINFO_PICKLE = base64.b64decode(
    "gASVVwAAAAAAAACMFGNlbGVyeV9kbG9jay5yZWRsb2NrlIwITG9ja0luZm+Uk5QpgZR9lCiMA2tleZSMAWuUjAZob2x"
    "kZXKUTowIdHRsX2xlZnSUTowFZmVuY2WUSwd1Yi4="
)


def test_a_lock_info_pickled_by_the_old_version_loads() -> None:
    # ModuleNotFoundError: No module named 'celery_dlock.redlock' (it is celery_dlock.redis.redlock
    # now, and LockInfo lives in celery_dlock.holder; no shim was left at the old path).
    from celery_dlock import LockInfo

    info = pickle.loads(OLD_LOCKINFO_PICKLE)
    assert info == LockInfo("k", None, None, 7)


def test_the_old_version_loads_a_lock_info_the_new_version_pickled(old_tree: Path) -> None:
    from celery_dlock import LockInfo

    out = run_with(
        old_tree,
        "import pickle, sys\n"
        "info = pickle.loads(sys.stdin.buffer.read())\n"
        "print(info.key, info.fence)\n",
        stdin=pickle.dumps(LockInfo("k", _holder(), 1.0, 7), protocol=4),
    )
    assert out.split() == [b"k", b"7"]


# -- 4. the same through Celery's own result backend (pickle result_serializer) -------------


def test_a_celery_pickle_result_backend_gives_a_new_client_the_old_workers_lock_contended(
    old_tree: Path,
) -> None:
    # An old worker stores the failure of an on_duplicate="raise" task; a new client's
    # result.get() decodes it. Celery wraps the AttributeError as kombu's DecodeError.
    from celery import Celery

    setup = (
        "from celery import Celery\n"
        "app = Celery('x', backend='cache+memory://')\n"
        "app.conf.result_serializer = 'pickle'\n"
        "app.conf.result_accept_content = ['pickle']\n"
    )
    blob = run_with(
        old_tree,
        setup + "import sys\n"
        "from celery_dlock import Holder, LockContended\n"
        "h = Holder(token='n1', holder='tid', host='h', pid=1, since=2.0, fence=3)\n"
        "e = LockContended('held', key='k', holder=h, retry_after=1.5)\n"
        "b = app.backend\n"
        "sys.stdout.buffer.write(b.encode(b.prepare_exception(e)))\n",
    )
    app = Celery("x", backend="cache+memory://", set_as_current=False)
    app.conf.result_serializer = "pickle"
    app.conf.result_accept_content = ["pickle"]
    error = app.backend.exception_to_python(app.backend.decode(blob))
    assert isinstance(error, LockContended)
    assert error.holder is not None
    assert error.holder.holder == "tid"


# -- 5. signatures of public callables (minor: keyword callers and introspecting tools) ------


def test_holder_signature_still_names_its_fields() -> None:
    # 205c568: (token, holder, host, pid, since, fence, queued=False, task=None); now
    # (*args, **kwargs): tools that build or validate from the signature (pydantic, cattrs,
    # inspect-based serializers) no longer see the fields.
    import inspect

    assert list(inspect.signature(Holder).parameters) == [
        "token",
        "holder",
        "host",
        "pid",
        "since",
        "fence",
        "queued",
        "task",
    ]


@pytest.mark.parametrize(
    ("where", "name", "first"),
    [
        ("celery_dlock.admin", "node_errors", "manager"),
        ("celery_dlock", "Lease", "manager"),
        ("celery_dlock", "LockGuard", "manager"),
    ],
)
def test_public_callables_keep_their_parameter_names(where: str, name: str, first: str) -> None:
    # Renamed manager -> backend: a call by keyword (node_errors(manager=m)) is a TypeError now.
    import importlib
    import inspect

    target = getattr(importlib.import_module(where), name)
    assert next(iter(inspect.signature(target).parameters)) == first


# -- 6. admin.check (celery dlock check, and the worker's start-up report) -----------------


def test_check_counts_only_singleton_tasks_not_any_task_with_a_dlock_method() -> None:
    # admin.check now takes any task whose class has a callable ``_dlock`` for a SingletonTask
    # (it used to be isinstance(task, SingletonTask)) and calls ``task._dlock()``. A project's
    # own base class with a helper of that name (say ``_dlock(self, key)`` wrapping
    # celery_dlock.lock) makes check() raise TypeError: ``celery dlock check`` fails, and the
    # worker's start-up report is replaced by "could not check the lock nodes".
    from celery import Celery, Task

    from celery_dlock import SingletonTask, admin, lock

    app = Celery("check-duck", broker="memory://", set_as_current=False)
    app.conf.dlock_urls = ["redis://127.0.0.1:1/0"]

    class WithHelper(Task):  # type: ignore[type-arg]
        def _dlock(self, key: str) -> object:
            return lock(self.app, key)

    @app.task(base=WithHelper, shared=False, name="duck.helper")
    def helper() -> None: ...

    @app.task(base=SingletonTask, shared=False, name="duck.single")
    def single() -> None: ...

    report = admin.check(app, reach=False)
    # Tasks that other test modules made with shared=True join every app finalized after them:
    # look at this test's own two.
    assert "duck.single" in report.tasks
    assert "duck.helper" not in report.tasks
    assert not any("duck." in problem for problem in report.problems)
