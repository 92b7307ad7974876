"""Every object the library pickles loads across versions: pickles made by c53a04b (the tree
before the folders were the layers), kept in tests/upgrade/data/pickles-c53a04b/, load here as the
same objects, and pickles made here load in c53a04b's code (a rolling upgrade: old workers read
results new ones wrote).

Celery's other result serializers (JSON, msgpack, YAML) name an exception by ``exc_module`` and
its class name: the module names each class had in c53a04b are kept beside the pickles
(``modules.json``) and must still be each class's ``__module__``.

The fixtures are made by this file run as a script with c53a04b's tree first on the path, from
a directory other than the repository's (so that ``celery_dlock`` is the old one)::

    git worktree add /tmp/old c53a04b
    cd /tmp && PYTHONPATH=/tmp/old python REPO/tests/upgrade/test_pickles.py \
        REPO/tests/upgrade/data/pickles-c53a04b
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "upgrade" / "data" / "pickles-c53a04b"
OLD = "c53a04b"


def samples() -> dict[str, Any]:
    """One object of every pickled class, with every field set (built by whichever
    ``celery_dlock`` is imported: c53a04b's to make the fixtures, this tree's to compare)."""
    from celery_dlock import (
        ConfigError,
        DLockError,
        Holder,
        LockContended,
        LockInfo,
        LockLost,
        LockUnavailable,
    )
    from celery_dlock.compat import AlreadyQueued, DuplicateTaskError

    holder = Holder(
        token="ab" * 20,
        holder="task-1",
        host="worker-1",
        pid=4242,
        since=1764200000.5,
        fence=17,
        queued=True,
        task="proj.tasks.sync",
    )
    return {
        "dlock_error": DLockError("something failed", key="meta:a"),
        "lock_contended": LockContended(
            "meta:a is held", key="meta:a", holder=holder, retry_after=2.5
        ),
        "lock_contended_bare": LockContended("meta:b is held", key="meta:b"),
        "lock_lost": LockLost("lease lost", key="meta:a", reason="expired", token=17),
        "lock_unavailable": LockUnavailable(
            "no quorum", key="meta:a", errors=[("redis://h1:6379/0", "Connection refused")]
        ),
        "config_error": ConfigError("dlock_urls is empty"),
        "holder": holder,
        "lock_info": LockInfo(key="meta:a", holder=holder, ttl_left=8.25, fence=17),
        "lock_info_free": LockInfo(key="meta:c", holder=None, ttl_left=None, fence=None),
        "already_queued": AlreadyQueued(12.5),
        "duplicate_task_error": DuplicateTaskError("already queued", "task-2"),
    }


def state(obj: Any) -> Any:
    """What must survive a round trip: the type's name and module, and its fields."""
    if isinstance(obj, BaseException):
        return (type(obj).__module__, type(obj).__qualname__, obj.args, _fields(obj.__dict__))
    return (type(obj).__module__, type(obj).__qualname__, obj)


def _fields(fields: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if not name.startswith("__")}


def make(where: Path) -> None:
    """Write one pickle per sample and the classes' module names into ``where``."""
    where.mkdir(parents=True, exist_ok=True)
    modules = {}
    for name, obj in samples().items():
        (where / f"{name}.pickle").write_bytes(pickle.dumps(obj))
        modules[name] = [type(obj).__module__, type(obj).__qualname__]
    (where / "modules.json").write_text(json.dumps(modules, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("name", sorted(samples()))
def test_a_pickle_made_by_c53a04b_loads_as_the_same_object(name: str) -> None:
    loaded = pickle.loads((DATA / f"{name}.pickle").read_bytes())
    assert state(loaded) == state(samples()[name])


def test_every_class_keeps_the_module_name_it_had_in_c53a04b() -> None:
    old = json.loads((DATA / "modules.json").read_text())
    now = {name: [type(obj).__module__, type(obj).__qualname__] for name, obj in samples().items()}
    assert now == old


def test_every_module_a_class_is_serialized_under_is_loaded_with_the_package() -> None:
    """Celery rebuilds an exception from JSON, msgpack or YAML by ``exc_module`` only when that
    module is already in ``sys.modules`` (else it makes a look-alike in celery.exceptions)."""
    named = json.loads((DATA / "modules.json").read_text()).values()
    # compat's exceptions are raised only where compat is imported, which loads its modules
    modules = sorted({m for m, _ in named if not m.startswith("celery_dlock.compat.")})
    code = f"import sys, celery_dlock; print([m for m in {modules!r} if m not in sys.modules])"
    done = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    )
    assert done.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        blob = subprocess.run(
            ["git", "-C", str(ROOT), "archive", OLD, "celery_dlock"],
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"{OLD} is not in this clone")
    where = tmp_path_factory.mktemp("old-c53a04b")
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(where)
    return where


def test_pickles_made_here_load_in_c53a04b(old_tree: Path, tmp_path: Path) -> None:
    """c53a04b's code unpickles each pickle made here into the object it would have built itself
    (fields this tree added ride along as extra attributes and are not compared)."""
    new = tmp_path / "new"
    make(new)
    code = (
        "import pickle, runpy, sys\n"
        "from pathlib import Path\n"
        "import celery_dlock\n"
        f"assert celery_dlock.__file__.startswith({str(old_tree)!r}), celery_dlock.__file__\n"
        "here = runpy.run_path(sys.argv[1])\n"
        "state, samples = here['state'], here['samples']()\n"
        "for path in sorted(Path(sys.argv[2]).glob('*.pickle')):\n"
        "    loaded = pickle.loads(path.read_bytes())\n"
        "    assert state(loaded) == state(samples[path.stem]), path.stem\n"
        "    print(path.stem)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, __file__, str(new)],
        check=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(old_tree)},
        capture_output=True,
        text=True,
    )
    assert done.stdout.split() == sorted(samples())


if __name__ == "__main__":
    make(Path(sys.argv[1]))
