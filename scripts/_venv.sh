# Sourced by the README's commands: make the virtualenv with the given extras installed, once.
# Usage: . scripts/_venv.sh "test,docs"
# DLOCK_VENV picks another virtualenv directory (absolute, or relative to the repository).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras="$1"
py="${PYTHON:-python3}"
venv="${DLOCK_VENV:-.venv}"
case "$venv" in
    /*) ;;
    *) venv="$PWD/$venv" ;;
esac
if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
fi
# Reinstall when pyproject.toml or the extras change; skip otherwise (fast re-runs).
stamp="$venv/.installed-$(echo "$extras" | tr ',' '-')"
want="$( (cat pyproject.toml; echo "$extras") | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$venv/bin/python" -m pip install -q -e ".[$extras]"
    echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
