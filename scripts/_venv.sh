# Sourced by the README's commands: make the virtualenv with the given extras installed, once.
# Usage: . scripts/_venv.sh "test,docs"
# DLOCK_VENV picks another virtualenv directory (absolute, or relative to where the command
# was run from); the default is .venv in the repository. Leaves the shell in the repository,
# with $caller the directory the command was run from and $repo the repository.
set -euo pipefail
caller="$PWD"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
extras="$1"
py="${PYTHON:-python3}"
if [ -n "${DLOCK_VENV:-}" ]; then
    case "$DLOCK_VENV" in
        /*) venv="$DLOCK_VENV" ;;
        *) venv="$caller/$DLOCK_VENV" ;;
    esac
else
    venv="$repo/.venv"
fi
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
