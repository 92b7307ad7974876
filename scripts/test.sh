#!/usr/bin/env bash
# The whole test suite: lint, types, tests against real redis-server processes.
# Needs only python3 (3.10+) and pip; installs everything else into .venv.
# Extra arguments go to pytest, e.g. scripts/test.sh -k fencing
set -euo pipefail
. "$(dirname "$0")/_venv.sh" "test"
echo "== ruff"; ruff check . && ruff format --check .
echo "== mypy (strict)"; mypy celery_dlock example_project
echo "== docs (mkdocs --strict)"; mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
echo "== pytest"; python -m pytest "$@"
