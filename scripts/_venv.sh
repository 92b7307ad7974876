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
# Reinstall when pyproject.toml or the extras change; skip otherwise (fast re-runs).
stamp="$venv/.installed-$(echo "$extras" | tr ',' '-')"
want="$( (cat pyproject.toml; echo "$extras") | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    # One line, then pip's output only if it fails: setuptools' editable-install banner (a
    # warning about folders named like the package) would otherwise be the first thing a
    # newcomer reads.
    echo "== installing celery-dlock[$extras] into $venv" >&2
    pip_log="$(mktemp)"
    if ! { { [ -x "$venv/bin/python" ] || { "$py" -m venv "$venv" \
               && "$venv/bin/python" -m pip install -q --upgrade pip; }; } \
           && "$venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[$extras]"; \
         } >"$pip_log" 2>&1; then
        cat "$pip_log" >&2
        rm -f "$pip_log"
        echo "making $venv with celery-dlock[$extras] failed (above)" >&2
        return 1 2>/dev/null || exit 1
    fi
    rm -f "$pip_log"
    echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
