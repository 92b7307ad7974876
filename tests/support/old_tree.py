"""The tree of the commit before the layering refactor (205c568), for tests that run old and
new code side by side: unpacked from git, skipped when the clone lacks the commit."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
OLD = "205c5681d4e2bb115e59eba0364824f791f0d67e"


def unpack(factory: pytest.TempPathFactory, name: str, *paths: str) -> Path:
    """``paths`` of the old tree, in a fresh directory ``name`` (pytest.skip without it)."""
    try:
        blob = subprocess.run(
            ["git", "-C", str(ROOT), "archive", OLD, *paths],
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"{OLD[:7]} is not in this clone")
    where = factory.mktemp(name)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(where)
    return where


def run_old(root: Path, env: dict[str, Any], code: str) -> str:
    """Run ``code`` in a Python process on the old tree at ``root``; its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env, "PYTHONPATH": str(root)},
        cwd=root,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return done.stdout.decode().strip()
