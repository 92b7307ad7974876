#!/usr/bin/env bash
# examples/testing_project as a user runs it: build celery-dlock's wheel, install it with the
# project's test extras into a fresh virtualenv (no editable install, no tests/ of this
# repository), and run the project's tests on the in-process store and on the plugin's
# throwaway Redis. DLOCK_EXAMPLE_VENV picks the virtualenv (default: a new temporary one).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
venv="${DLOCK_EXAMPLE_VENV:-$work/venv}"
echo "== building the celery-dlock wheel"
"$py" -m pip wheel -q --disable-pip-version-check --no-deps -w "$work/dist" "$repo"
wheel="$(ls "$work"/dist/celery_dlock-*.whl)"
echo "== a fresh virtualenv with $(basename "$wheel")[server], pytest, pytest-celery, freezegun"
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
    "${wheel}[server]" "pytest>=8" "pytest-celery>=1.0" "freezegun>=1.5"
# The project's tests, from a copy: nothing of the repository is on the path.
cp -r "$repo/examples/testing_project" "$work/project"
cd "$work/project"
echo "== examples/testing_project on memory://"
"$venv/bin/python" -m pytest -q
echo "== examples/testing_project on a throwaway Redis"
SHOP_LOCKS=redis "$venv/bin/python" -m pytest -q
