"""Hostile input: task arguments that come from web requests, URLs written carelessly, a lock
store shared with other applications (issue 31).

Each section is one way untrusted input could leak a secret, merge two resources, corrupt a
terminal, exhaust memory or block a key; each test runs against real servers (redis-server,
ZooKeeper, ``celery worker`` processes, the ``celery dlock`` command).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from celery_dlock import ConfigError, lock
from celery_dlock.core.config import Settings
from celery_dlock.core.urls import redact
from celery_dlock.testing import RedisServer
from tests.ops.test_cli import dlock as dlock_cli
from tests.support.celery_fixtures import with_db
from tests.support.workers import Journal, Worker

MODES = ["single"]
ROOT = Path(__file__).resolve().parents[2]

# -- 1. passwords with reserved characters are never printed ----------------------------------

#: Every character a URL parser may split a password at (and some that need no encoding).
RESERVED = "/#?@:%&=;[] +,$!'()*"
#: Two halves of a password around a reserved character; neither may ever be printed.
HALVES = ("s3cr", "etX9")


def password(char: str) -> str:
    return f"{HALVES[0]}{char}{HALVES[1]}"


def url_forms(secret: str) -> list[str]:
    """A URL of every scheme (and every place a password goes) holding ``secret``."""
    return [
        f"redis://:{secret}@127.0.0.1:1/0",
        f"redis://user:{secret}@127.0.0.1:1/0",
        f"rediss://user:{secret}@127.0.0.1:1/0",
        f"redis://127.0.0.1:1/0?password={secret}",
        f"unix://:{secret}@/nonexistent/redis.sock",
        f"redis+sentinel://:{secret}@127.0.0.1:1,127.0.0.1:2/mymaster/0",
        f"redis+sentinel://127.0.0.1:1/mymaster/0?sentinel_password={secret}",
        f"rediss+sentinel://u:{secret}@127.0.0.1:1/mymaster/0",
        f"redis+cluster://:{secret}@127.0.0.1:1,127.0.0.1:2",
        f"zookeeper://user:{secret}@127.0.0.1:1/x",
        f"zookeepers://user:{secret}@127.0.0.1:1/x",
    ]


def leaked(text: str) -> bool:
    return any(half in text for half in HALVES)


def raw_and_encoded() -> Iterator[tuple[str, str]]:
    for char in RESERVED:
        for secret in (password(char), quote(password(char), safe="")):
            for url in url_forms(secret):
                yield char, url


@pytest.mark.parametrize("char", list(RESERVED))
def test_redact_hides_a_password_with_any_reserved_character(char: str) -> None:
    """``redact`` hides the password of every scheme, raw and percent-encoded (on c53a04b:
    ``redis://:s3cr/etX9@...`` came back whole)."""
    shown = {url: redact(url) for c, url in raw_and_encoded() if c == char}
    assert not [s for s in shown.values() if leaked(s)], shown


#: Tries each URL (argv[1], JSON) on an unreachable node, in a child process: the attempts
#: leave retries behind (a void owed to a silent node), which must not outlive the test.
@pytest.mark.parametrize(
    "option", ["pass%77ord", "%70assword", "PASS%57ORD", "sentinel_%70assword", "pass%77ord[]"]
)
def test_a_password_option_whose_name_is_percent_encoded_is_hidden(option: str) -> None:
    """redis-py decodes a query option's name (``?pass%77ord=`` is ``password``): on 6005d89
    ``redact`` matched the name as written and printed the password."""
    from redis.connection import parse_url

    url = f"redis://127.0.0.1:1/0?db=0&{option}={password('&')}"
    if option in ("pass%77ord", "%70assword"):
        assert parse_url(url)["password"].startswith(HALVES[0])  # a password to redis-py
    assert not leaked(redact(url)), redact(url)
    assert redact(url).startswith("redis://127.0.0.1:1/0?db=0&")


ATTEMPT = """
import json, logging, sys
logging.basicConfig(level=logging.DEBUG)  # every library log line goes to stderr
from celery_dlock import DLockError, lock
from celery_dlock.core.config import Settings
found = {}
for url in json.loads(sys.argv[1]):
    try:
        Settings(urls=(url,), node_timeout=0.2)
    except DLockError as exc:
        found[url] = str(exc)
        continue
    if url.startswith("zookeeper"):
        continue  # connecting would wait out a session timeout; the text is the same
    try:
        with lock([url], "k", wait=0, ttl=5):
            pass
    except DLockError as exc:
        found[url] = f"{exc} {exc!r}"
print(json.dumps(found))
"""


@pytest.mark.parametrize("char", list(RESERVED))
def test_no_error_for_any_scheme_prints_a_password(char: str) -> None:
    """Settings, then (for the URLs that pass) an attempt on an unreachable node: neither
    error shows a half of the password (on c53a04b the ConfigError for a raw ``/``, ``#`` or
    ``?`` printed the URL whole)."""
    urls = [url for c, url in raw_and_encoded() if c == char]
    done = subprocess.run(
        [sys.executable, "-c", ATTEMPT, json.dumps(urls)],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found: dict[str, str] = json.loads(done.stdout)
    assert len(found) >= len(urls) - 4  # every URL gave an error but the ZooKeeper ones
    assert not {u: t for u, t in found.items() if leaked(t)}, found
    assert not leaked(done.stderr), done.stderr


@pytest.mark.parametrize("char", ["/", "#", "?"])
def test_a_raw_reserved_character_in_a_password_is_refused_with_the_fix(char: str) -> None:
    """What URL parsers cannot read as a password is refused, saying how to write it."""
    for url in url_forms(password(char)):
        if "password=" in url:
            continue  # in a query value '/' and '?' are plain characters
        with pytest.raises(ConfigError) as info:
            Settings(urls=(url,))
        assert "percent-encode" in str(info.value), (url, str(info.value))
        assert not leaked(str(info.value))


@pytest.fixture(scope="module")
def guarded() -> Iterator[RedisServer]:
    """A Redis whose password holds a raw ``/``."""
    with RedisServer(extra_args=["--requirepass", password("/")]) as server:
        yield server


@pytest.mark.local_redis
@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_a_raw_slash_password_is_never_printed_by_a_worker_or_the_cli(
    guarded: RedisServer, celery_base: str, tmp_path: Path, level: str
) -> None:
    """A real worker whose ``dlock_urls`` holds ``redis://:s3cr/etX9@...`` stops at start
    (such a URL cannot authenticate) saying to percent-encode, its log at INFO and DEBUG never
    showing the password; nor do ``celery dlock list/show/check``. (On c53a04b the worker ran,
    and its warning, each task's error and traceback and the result record showed it; since
    the merge of issue 32 it stops at start, which this test, written when it still ran,
    failed on at 6005d89: 'worker hostile-url did not start'.)"""
    from tests.celery.test_worker_config import worker

    url = f"redis://:{password('/')}@127.0.0.1:{guarded.port}/0"
    code, output = worker(
        tmp_path, "hostile_url", with_db(celery_base, 10), f"app.conf.dlock_urls = [{url!r}]",
        args=("-l", level),
    )  # fmt: skip
    assert code not in (None, 0), output[-3000:]
    assert "percent-encode" in output, output[-3000:]
    texts = {"worker log": output}
    for args in (["list"], ["show", "k"], ["check"]):
        done = dlock_cli([url], *args)
        texts[f"dlock {args[0]}"] = done.stdout + done.stderr
    assert {name: leaked(text) for name, text in texts.items()} == dict.fromkeys(texts, False), (
        texts
    )


@pytest.mark.local_redis
def test_a_raw_at_and_colon_password_works_and_is_never_printed() -> None:
    """``:`` and ``@`` in a password need no encoding (the last ``@`` ends it): the lock
    works, and the CLI shows the URL with the password hidden."""
    secret = f"{HALVES[0]}@:{HALVES[1]}"
    with RedisServer(extra_args=["--requirepass", secret]) as server:
        url = f"redis://:{secret}@127.0.0.1:{server.port}/0"
        with lock([url], "works", ttl=5):
            shown = dlock_cli([url], "list")
        assert shown.returncode == 0, shown.stderr
        assert "works" in shown.stdout
        assert f"redis://:***@127.0.0.1:{server.port}/0" in shown.stdout
        assert not leaked(shown.stdout + shown.stderr)
        assert json.loads(dlock_cli([url], "show", "works", "--json").stdout)["held"] is False


REPORT_APP = """
from celery import Celery
import celery_dlock  # noqa: F401  (what an app using the library imports)
app = Celery("report_app", broker="redis://127.0.0.1:1/0")
app.conf.dlock_urls = {urls!r}
"""


def test_celery_report_and_inspect_conf_hide_the_lock_urls_passwords(tmp_path: Path) -> None:
    """``celery report`` prints every setting changed, and a worker answers ``celery inspect
    conf`` with ``app.conf.table()``: Celery hides settings by name (``PASS``, ``SECRET``,
    ``broker_url``, ``*backend*``), which ``dlock_urls`` is not, so on 6005d89 both printed its
    passwords whole. Each URL form, raw and encoded."""
    urls = [url for _, url in raw_and_encoded()]
    (tmp_path / "report_app.py").write_text(REPORT_APP.format(urls=urls))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    celery = [sys.executable, "-m", "celery", "-A", "report_app"]
    report = subprocess.run(
        [*celery, "report"], capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert report.returncode == 0, report.stderr
    assert "dlock_urls" in report.stdout
    table = subprocess.run(
        [sys.executable, "-c", "import json, report_app; "
         "print(json.dumps(report_app.app.conf.table(), default=repr))"],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert table.returncode == 0, table.stderr
    shown = json.loads(table.stdout)["dlock_urls"]
    assert "127.0.0.1:1" in "".join(shown)  # the hosts are still shown
    assert not leaked(report.stdout + report.stderr), report.stdout
    assert not leaked(table.stdout), shown


# -- 2. a filled template is injective in its arguments --------------------------------------


def test_two_calls_a_separator_could_merge_run_both_in_a_real_worker(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    """``meta:{source}:{entity}`` with ``("acme:eu", "invoice-7")`` held, then
    ``("acme", "eu:invoice-7")``: two resources, two keys, both run (on c53a04b the second
    was dropped as a duplicate, and its result was the first one's); so do ``None`` and
    ``"None"``."""
    first = wa.collect.delay("acme:eu", "invoice-7", secs=2.0)
    journal.wait_for("start", timeout=20, id=first.id)
    second = wa.collect.delay("acme", "eu:invoice-7")
    assert second.get(timeout=20) == "acme:eu:invoice-7"  # ran, not dropped
    assert first.get(timeout=20) == "acme:eu:invoice-7"
    held = wa.collect.delay("src", None, secs=2.0)
    journal.wait_for("start", timeout=20, id=held.id)
    assert wa.collect.delay("src", "None").get(timeout=20) == "src:None"
    held.get(timeout=20)
    keys = [e["key"] for e in journal.select("start")]
    assert keys == [
        "meta:acme%3Aeu:invoice-7",  # the ':' inside a value is escaped ...
        "meta:acme:eu:invoice-7",  # ... in the last field too it need not be
        "meta:src:None",
        "meta:src:%4E%6F%6E%65",
    ]


@pytest.mark.parametrize("conversion", ["", "!s", "!r", "!a"])
@pytest.mark.parametrize("constant", [None, True, False])
def test_a_conversion_keeps_a_constant_and_its_text_apart(conversion: str, constant: Any) -> None:
    """``{b!s}`` turns ``None`` into the str ``"None"`` before it is filled in: on 6005d89 it was
    then encoded as a str reading ``None`` is, and ``None`` and ``"None"`` shared one key."""
    from celery_dlock.celery.keys import KeyBuilder

    def run(a: Any, b: Any) -> None: ...

    keys = KeyBuilder("t", run, f"k:{{a}}:{{b{conversion}}}")
    assert keys(("x", constant), {}) != keys(("x", str(constant)), {})


KEY_IN_A_PROCESS = """
import json, sys
from celery_dlock.celery.keys import KeyBuilder
def run(a, b): ...
keys = KeyBuilder("t", run, "k:{a}:{b}")
print(json.dumps([keys(({"alpha", "beta", "gamma", "delta"}, 1), {}),
                  keys((frozenset({"x", "y", "z"}), 1), {})]))
"""


def test_a_container_fills_in_one_key_in_every_process() -> None:
    """A publisher and a worker are two processes with two string hash seeds: a set filled in
    by its ``str()`` came out in another order in each (on 6005d89 eight seeds gave up to 8
    keys for one call, so a pickle or YAML task's two runs did not exclude each other)."""

    def key_in_a_process(seed: int) -> str:
        return subprocess.run(
            [sys.executable, "-c", KEY_IN_A_PROCESS], capture_output=True, text=True,
            timeout=60, check=True, cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout  # fmt: skip

    keys = {key_in_a_process(seed) for seed in range(8)}
    assert len(keys) == 1, keys


def test_a_container_fills_in_a_canonical_text_no_string_can() -> None:
    """Dict order does not matter; a list and the string of its ``str()`` are two resources;
    an object keyed by its address (different in every process) is refused naming it."""
    from celery_dlock.celery.keys import KeyBuilder

    def run(a: Any, b: Any) -> None: ...

    keys = KeyBuilder("t", run, "k:{a}:{b}")
    assert keys(({"b": 1, "a": 2}, 1), {}) == keys(({"a": 2, "b": 1}, 1), {})
    assert keys((["y"], 1), {}) != keys(("['y']", 1), {})
    assert keys((["y"], 1), {}) != keys(('["y"]', 1), {})
    assert keys(({"k": 1}, 1), {}) != keys(("{'k': 1}", 1), {})
    assert keys((b"x", 1), {}) != keys(("b'x'", 1), {})
    assert keys((("y",), 1), {}) == keys((["y"], 1), {})  # as for the other key forms
    with pytest.raises(ConfigError, match="argument 'a'"):
        keys((object(), 1), {})


@pytest.mark.parametrize(
    ("template", "value"),
    [
        ("k:{a[0]}", []),
        ("k:{a[k]}", {}),
        ("k:{a[0]}", None),
        ("k:{a.real}", "s"),
        ("k:{a:d}", "5"),
        ("k:{a:s}", None),
    ],
)
def test_a_value_a_field_cannot_be_filled_from_is_a_config_error_naming_it(
    template: str, value: Any
) -> None:
    """An index, attribute or format spec that a request's value does not fit (an empty list,
    a str where an int was meant): on 6005d89 a bare IndexError, KeyError, AttributeError,
    ValueError or TypeError that named neither the argument nor the template."""
    from celery_dlock.celery.keys import KeyBuilder

    def run(a: Any) -> None: ...

    with pytest.raises(ConfigError, match=r"task 't': argument 'a' \(.*\) cannot fill"):
        KeyBuilder("t", run, template)((value,), {})


def test_a_value_cannot_forge_a_long_keys_shortened_form() -> None:
    """A key longer than 200 characters is its first 64 and ``…sha256:<digest>``, all of
    which anyone knowing the call can compute: on 6005d89 a request whose value was that text
    (after the template's literal) filled in the very same key, and took the long call's
    lock. A filled key that reads like a shortened one is shortened in turn."""
    from celery_dlock.celery.keys import KeyBuilder

    def run(url: str) -> None: ...

    keys = KeyBuilder("t", run, "fetch:{url}")
    victim = keys(("https://example.com/" + "a" * 300,), {})
    assert "…sha256:" in victim
    forged = victim.removeprefix("fetch:")
    assert keys((forged,), {}) != victim
    assert keys((forged,), {}) == keys((forged,), {})


def test_side_by_side_fields_are_refused_at_definition() -> None:
    from celery import Celery

    from celery_dlock import SingletonTask

    app = Celery("side", set_as_current=False)
    app.conf.dlock_urls = ["redis://127.0.0.1:1/0"]

    with pytest.raises(ConfigError, match=r"puts '\{a\}' and '\{b\}' side by side.*'\{a\}:\{b\}'"):

        @app.task(base=SingletonTask, lock_key="k:{a}{b}", shared=False)
        def joined(a: str, b: str) -> None: ...

        joined.lock_key_for(("ab", "c"), {})


# -- 3. least privilege: the workers' ACL line has no SCAN ------------------------------------


@pytest.mark.local_redis
def test_a_worker_runs_its_tasks_as_the_acl_user_without_scan(celery_base: str, wa: Any) -> None:
    """A real prefork worker whose lock URL is a user made with exactly the workers' line of
    docs/topologies.md runs SingletonTasks (take, contend and drop, wait and be woken); that
    user cannot SCAN another application's keys; the operator's line can list (on c53a04b
    the one line there was granted ``+scan``)."""
    import redis

    from celery_dlock.backends.redis.diagnose import acl_rules

    worker_line = acl_rules()
    assert "+scan" not in worker_line.split()
    assert "+scan" in acl_rules(operator=True).split()
    with RedisServer() as server:
        admin = redis.Redis(port=server.port)
        admin.set("other-app:session:42", "secret-session")
        for user, rules in (("dlock", worker_line), ("dlock-admin", acl_rules(operator=True))):
            admin.execute_command(
                "ACL", "SETUSER", user, "reset", "on", ">pw", "-@all", *rules.split()
            )
        url = f"redis://dlock:pw@127.0.0.1:{server.port}/0"
        as_worker = redis.Redis.from_url(url)
        with pytest.raises(redis.exceptions.NoPermissionError):
            as_worker.scan(match="*")
        env = {
            "DLOCK_TEST_BROKER": with_db(celery_base, 10),
            "DLOCK_TEST_BACKEND": with_db(celery_base, 11),
            "DLOCK_TEST_JOURNAL": with_db(celery_base, 13),
            "DLOCK_TEST_LOCK_URLS": url,
        }
        journal = Journal(env["DLOCK_TEST_JOURNAL"])
        journal.clear()
        queue = "acl-worker"  # its own: the module's other worker must not take these
        worker = Worker(env, journal, name="acl-worker", concurrency=3, queue=queue).start()
        try:
            held = wa.drop_task.apply_async(("acl-drop", 8.0), queue=queue)
            journal.wait_for("start", timeout=20, id=held.id)
            dropped = wa.drop_task.apply_async(("acl-drop", 8.0), queue=queue).get(timeout=20)
            waiting = [
                wa.wait_task.apply_async(("acl-wait", n, 0.3), queue=queue) for n in range(2)
            ]
            assert sorted(r.get(timeout=30) for r in waiting) == [0, 1]
            assert held.get(timeout=20) == "acl-drop"
            log = worker.log()
        finally:
            worker.stop()
        assert dropped["dlock_dropped"] is True
        assert "NOPERM" not in log, log
        assert "NoPermission" not in log, log
        listed = dlock_cli([url.replace("dlock:", "dlock-admin:")], "list")
        assert listed.returncode == 0, listed.stderr
        refused = dlock_cli([url], "list")
        assert refused.returncode == 1
        assert refused.stderr.rstrip().endswith(f"ACL SETUSER dlock {acl_rules(operator=True)}")


@pytest.mark.local_redis
def test_the_worker_line_runs_beat_enqueue_time_locks_and_the_operator_commands_but_list(
    celery_base: str, wa: Any
) -> None:
    """The workers' ACL line is enough for a LeaderScheduler beat (leader key, tick keys), an
    enqueue-time lock taken by the publisher, and ``celery dlock show/release/check``; only
    ``list`` and ``purge`` (SCAN) need the operator's line."""
    import redis

    from celery_dlock.backends.redis.diagnose import acl_rules
    from tests.support.workers import Beat

    with RedisServer() as server:
        admin = redis.Redis(port=server.port)
        admin.execute_command(
            "ACL", "SETUSER", "dlock", "reset", "on", ">pw", "-@all", *acl_rules().split()
        )
        url = f"redis://dlock:pw@127.0.0.1:{server.port}/0"
        env = {
            "DLOCK_TEST_BROKER": with_db(celery_base, 10),
            "DLOCK_TEST_BACKEND": with_db(celery_base, 11),
            "DLOCK_TEST_JOURNAL": with_db(celery_base, 13),
            "DLOCK_TEST_LOCK_URLS": url,
        }
        journal = Journal(env["DLOCK_TEST_JOURNAL"])
        journal.clear()
        queue = "acl-beat"
        # Beat sends to the default queue: this worker takes it too (the module's shared
        # worker, if it runs, would key those ticks on its own Redis; the beat claims each
        # tick on this one before it sends, which is what is under test).
        worker = Worker(
            env, journal, name="acl-beat", concurrency=2, queue=f"{queue},celery"
        ).start()
        beat_env = {**env, "DLOCK_TEST_BEAT": "acl-led:0", "DLOCK_TEST_BEAT_TTL": "3"}
        beat = Beat(beat_env, name="acl-beat", scheduler="dlock").start()
        previous = wa.app.conf.get("dlock_urls")
        try:
            from tests.support.workers import use_lock_urls

            use_lock_urls(wa.app, [url])
            held = wa.enqueued.apply_async(("acl-enq", 3.0), queue=queue)
            journal.wait_for("start", timeout=20, id=held.id)
            duplicate = wa.enqueued.apply_async(("acl-enq", 0.0), queue=queue)
            journal.wait_for("start", timeout=30, count=2, name="acl-led")
            shown = dlock_cli([url], "show", "beat-leader:worker_app", "--json")
            checked = dlock_cli([url], "check", "--no-reach")
            released = dlock_cli([url], "release", "beat-leader:worker_app", "--yes")
            assert held.get(timeout=20) == "acl-enq"
            beat_log = beat.log()
        finally:
            beat.stop()
            worker.stop()
            use_lock_urls(wa.app, previous)
        log = worker.log()
    assert duplicate.id != held.id
    for name, text in (("worker", log), ("beat", beat_log)):
        assert "NOPERM" not in text, (name, text)
        assert "NoPermission" not in text, (name, text)
    assert shown.returncode == 0, shown
    assert json.loads(shown.stdout)["held"] is True, shown
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert released.returncode == 0, released.stdout + released.stderr


# -- 4. the operator command's table cannot be forged or reach the terminal's escapes -------

EVIL_KEY = "evil\nforged-row  x  y\x1b[2J\x1b]0;pwned\x07\u202e"


def test_list_and_show_escape_keys_and_holder_fields(single_urls: list[str]) -> None:
    """A key with a newline, ESC sequences and a bidi override, and a holder whose host field
    (written by something else into the lock store) holds ESC: ``dlock list`` prints one
    row per lock, no ESC byte, the key escaped as Python writes it; ``--json`` is unchanged
    JSON (on c53a04b the table printed them raw: a forged row, a cleared screen)."""
    from tests.support.clients import client

    url = single_urls[0]
    forged = {
        "token": "t" * 27,
        "holder": "id\n2",
        "host": "\x1b[31mhost",
        "pid": 1,
        "since": 0,
        "fence": 5,
        "task": "t\x1b[0m",
    }
    client(url).set("dlock:{other\x1b[1m}", json.dumps(forged), px=30_000)
    with lock([url], EVIL_KEY, ttl=30):
        table = dlock_cli([url], "list")
        shown = dlock_cli([url], "show", EVIL_KEY)
        forged_shown = dlock_cli([url], "show", "other\x1b[1m")
        as_json = dlock_cli([url], "list", "--json")
    for done in (table, shown, forged_shown, as_json):
        assert done.returncode == 0, done.stderr
        assert "\x1b" not in done.stdout + done.stderr
        assert "\x07" not in done.stdout
        assert "\u202e" not in done.stdout
    lines = table.stdout.splitlines()
    assert len(lines) == 4, lines  # "locks on ...", the header, two locks
    assert lines[2].startswith("evil\\nforged-row  x  y\\x1b[2J\\x1b]0;pwned\\x07\\u202e  ")
    assert "\\x1b[31mhost" in lines[3]
    assert "id\\n2" in lines[3]
    assert "key       evil\\nforged-row" in shown.stdout
    assert "host      \\x1b[31mhost" in forged_shown.stdout
    rows = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert sorted(r["key"] for r in rows) == sorted([EVIL_KEY, "other\x1b[1m"])
    assert {r["host"] for r in rows if r["key"] != EVIL_KEY} == {"\x1b[31mhost"}


#: Characters Unicode says to draw as nothing (Default_Ignorable_Code_Point) that Python
#: still calls printable: a key holding one looks like the key without it.
INVISIBLE = "\u034f\u115f\u1160\u17b4\u17b5\u180b\u180f\u3164\ufe00\ufe0f\uffa0\U000e0100\U000e01ef"


@pytest.mark.parametrize("char", list(INVISIBLE), ids=lambda c: f"U+{ord(c):04X}")
def test_a_key_that_looks_like_another_is_shown_escaped(single_urls: list[str], char: str) -> None:
    """``ab`` and ``a<char>b`` are two locks: ``dlock list`` must not print them
    alike (on 6005d89 ``list`` printed these raw, as ``ab``: a combining grapheme joiner, variation
    selectors, Hangul fillers), so an operator can tell which one to release."""
    from celery_dlock.ops.cli import printable

    url = single_urls[0]
    key = f"a{char}b"
    escape = f"\\U{ord(char):08x}" if ord(char) > 0xFFFF else f"\\u{ord(char):04x}"
    assert printable(key) == f"a{escape}b"
    with lock([url], key, ttl=30):
        table = dlock_cli([url], "list", "--prefix", "a")
    assert table.returncode == 0, table.stderr
    assert char not in table.stdout
    assert printable(key) in table.stdout


# -- 5. a lone surrogate is a library error, and costs the clean-up round nothing -----------


def test_a_lone_surrogate_fails_the_task_with_a_config_error_naming_it(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    """kombu's JSON turns ``"\\ud800"`` into a lone surrogate: the task fails with a
    ConfigError naming the argument (on c53a04b: a bare UnicodeEncodeError), and the worker's
    clean-up thread logs no failed round."""
    from celery_dlock import ConfigError as Refused

    result = wa.collect.delay("\ud800", "entity")
    with pytest.raises(Refused) as info:
        result.get(timeout=20)
    assert "task 'tests.worker_app.collect': argument 'source' holds a lone surrogate" in str(
        info.value
    )
    assert "janitor round failed" not in worker.log()
    assert wa.collect.delay("clean", "entity").get(timeout=20) == "clean:entity"
    with pytest.raises(Refused, match=r"lone surrogate \('\\udc80' at 2\)"):
        lock(wa.app, "ab\udc80", ttl=5).acquire()


def test_one_unsendable_item_does_not_drop_the_rest_of_a_janitor_round(
    single_urls: list[str],
) -> None:
    """Two voids due in one round, the first for a key no node can encode: the second still
    lands (on c53a04b the first's exception ended the round and the second was dropped)."""
    import time

    from celery_dlock.backends.redis.janitor import janitor
    from celery_dlock.core.registry import manager_for
    from tests.support.clients import client

    manager = manager_for(single_urls)
    head = '{"token":"janitor-test","holder":null,"fence":'
    good = manager.redis_keys("janitor-good")[0]
    client(single_urls[0]).set(good, head + "1}", px=30_000)
    until = time.monotonic() + 30
    bad = manager.redis_keys("janitor-\ud800")[0]
    with janitor._cond:  # both pushed before the thread can take either
        janitor.void(manager.nodes, bad, bad + ":void:x", head, until)
        janitor.void(manager.nodes, good, good + ":void:x", head, until)
    deadline = time.monotonic() + 10
    while client(single_urls[0]).exists(good) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not client(single_urls[0]).exists(good), "the good item was dropped with the bad"


# -- 6. what is read back from the lock store is bounded ------------------------------------

BIG = 128 * 1024 * 1024  # bytes of a value something else wrote under a lock key

#: A child that tries the key (argv: url, key) and reports its peak RSS (KiB) and the error.
CONTEND = """
import json, resource, sys
from celery_dlock import DLockError, lock
try:
    with lock([sys.argv[1]], sys.argv[2], wait=0, ttl=5):
        error = None
except DLockError as exc:
    error = f"{type(exc).__name__}: {exc}"
print(json.dumps([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, error]))
"""
#: A child that runs ``celery dlock show KEY`` (argv: url, key) and reports its peak RSS.
SHOW = """
import json, os, resource, subprocess, sys
env = {**os.environ, "DLOCK_TEST_LOCK_URLS": sys.argv[1]}
done = subprocess.run(
    [sys.executable, "-m", "celery", "-A", "tests.support.cli_app", "dlock", "show", sys.argv[2]],
    env=env, capture_output=True, text=True, check=False,
)
print(json.dumps([resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, done.stdout,
                  done.stderr]))
"""


def run_child(code: str, *args: str) -> list[Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result: list[Any] = json.loads(done.stdout)
    return result


@pytest.mark.local_redis
def test_a_huge_value_under_a_lock_key_costs_a_contender_and_the_cli_little_memory() -> None:
    """128 MB under a lock key (written by something else, with a ttl): a contender gets
    LockContended naming it, and ``dlock show`` describes it, each with a peak RSS well under
    the value's size (on c53a04b the contender read the value whole and, its transfer
    outlasting the node timeout, got LockUnavailable; show read it whole)."""
    with RedisServer() as server:
        admin = redis_client(server)
        key = "dlock:{huge}"
        admin.set(key, '{"token":"x","holder":null,"fence":1}')
        admin.setrange(key, BIG - 1, "!")
        admin.pexpire(key, 120_000)
        admin.set("dlock:{small}", "x" * 100, px=120_000)  # the same, 100 bytes: the baseline
        rss_kib, error = run_child(CONTEND, server.url, "huge")
        base_kib, _ = run_child(CONTEND, server.url, "small")
        shown_kib, out, err = run_child(SHOW, server.url, "huge")
        shown_base_kib, _, _ = run_child(SHOW, server.url, "small")
    assert error is not None
    assert error.startswith(
        f"LockContended: lock 'huge' is held by a value celery_dlock did not write ({BIG} bytes"
    ), error
    # Peak RSS over the same child with a 100-byte value: far below the value's size.
    assert (rss_kib - base_kib) * 1024 < BIG / 8, f"a contender: {rss_kib} vs {base_kib} KiB"
    assert f"'huge' is held by a value celery_dlock did not write ({BIG} bytes" in out, err
    assert (shown_kib - shown_base_kib) * 1024 < BIG / 8, (
        f"dlock show: {shown_kib} vs {shown_base_kib} KiB"
    )


def redis_client(server: RedisServer) -> Any:
    import redis

    return redis.Redis(port=server.port, socket_timeout=30)


# -- 9. a value without expiry is named, and not spun on ------------------------------------


def test_a_lock_value_without_expiry_is_named_and_not_spun_on(single_urls: list[str]) -> None:
    """A value in the lock's format with no ttl (something else SET or PERSISTed it): the
    contender's error says so and gives no retry_after; a waiter tries a few times, not in a
    spin (on c53a04b: retry_after 0.0, a waiter retried every millisecond; ``dlock list``
    showed ttl_left -0.001)."""
    from celery_dlock import LockContended
    from celery_dlock.core.holder import value_head
    from tests.support.clients import client

    url = single_urls[0]
    store = client(url)
    store.set("dlock:{forever}", value_head("someone-else") + "7}")
    with pytest.raises(LockContended) as info:
        lock([url], "forever", wait=0, ttl=5).acquire()
    assert info.value.retry_after is None
    assert "with no expiry: celery_dlock always sets one" in str(info.value)
    before = store.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    with pytest.raises(LockContended):
        lock([url], "forever", wait=1.0, ttl=5).acquire()
    after = store.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert after - before < 10, f"{after - before} script calls in a 1 s wait: a spin"
    listed = dlock_cli([url], "list")
    shown = dlock_cli([url], "show", "forever")
    assert "forever: no expiry: celery_dlock always sets one" in listed.stdout, listed.stdout
    assert "-0.001" not in listed.stdout
    assert "note      no expiry: celery_dlock always sets one" in shown.stdout, shown.stdout
    released = dlock_cli([url], "release", "forever", "--yes")  # what the error advises
    assert released.returncode == 0, released.stderr
    assert store.get("dlock:{forever}") is None


@pytest.mark.local_redis
def test_a_user_granted_the_older_acl_line_still_takes_locks() -> None:
    """Without ``+strlen +getrange`` (the line of 0.1.0) the scripts fall back to GET: locks
    are taken, contended, inspected and released as before."""
    import redis

    from celery_dlock import LockContended
    from celery_dlock.backends.redis.diagnose import acl_rules
    from celery_dlock.core.registry import manager_for

    older = acl_rules().replace(" +strlen +getrange", "")
    with RedisServer() as server:
        redis.Redis(port=server.port).execute_command(
            "ACL", "SETUSER", "old", "reset", "on", ">pw", "-@all", *older.split()
        )
        url = f"redis://old:pw@127.0.0.1:{server.port}/0"
        with lock([url], "older", ttl=5) as lease:
            with pytest.raises(LockContended, match="is held by a process on"):
                lock([url], "older", wait=0, ttl=5).acquire()
            info = manager_for([url]).inspect("older")
            assert info.holder is not None
            assert info.holder.fence == lease.token
        assert manager_for([url]).inspect("older").holder is None


# -- 7. a fence counter near 2**53 (or 2**63) never gives a token that is negative or falls --


@pytest.mark.parametrize(
    "counter", [str(2**63 - 1), str(2**53 - 1), str(2**53 + 7), "-5", "nan", "inf", "x" * 100]
)
def test_a_counter_at_the_bound_refuses_rather_than_issue_a_falling_token(
    single_urls: list[str], counter: str
) -> None:
    """On c53a04b a counter at 2**63 - 1 gave a negative token (``%d`` of 2**63), and one past
    2**53 tokens that did not rise (doubles)."""
    from celery_dlock import LockUnavailable
    from tests.support.clients import client

    url = single_urls[0]
    client(url).set("dlock:{fenced}:fence", counter)
    with pytest.raises(LockUnavailable) as info, lock([url], "fenced", ttl=5) as lease:
        raise AssertionError(f"issued token {lease.token}")
    assert f"its fencing counter dlock:{{fenced}}:fence holds {counter[:40].encode()!r}" in str(
        info.value
    )
    assert "not a count below 9007199254740991 (2**53 - 1)" in str(info.value)
    assert client(url).get("dlock:{fenced}") is None
    client(url).set("dlock:{fenced}:fence", str(2**53 - 2))
    with lock([url], "fenced", ttl=5) as lease:
        assert lease.token == 2**53 - 1  # the last token there is, exact
    with pytest.raises(LockUnavailable):
        lock([url], "fenced", ttl=5).acquire()


# -- 8. TLS without verification is said aloud; a misspelt ssl_cert_reqs is a ConfigError ---


@pytest.mark.parametrize(("given", "meant"), [("requried", "required"), ("NONE", "none")])
def test_a_misspelt_ssl_cert_reqs_is_a_config_error_naming_it(given: str, meant: str) -> None:
    """On c53a04b: a RedisError from redis-py at the first connection."""
    with pytest.raises(ConfigError) as info:
        Settings(urls=(f"rediss://:pw@127.0.0.1:1/0?ssl_cert_reqs={given}",))
    assert f"ssl_cert_reqs={given!r} is not one of required, optional, none" in str(info.value)
    assert f"did you mean {meant!r}?" in str(info.value)
    assert "pw" not in str(info.value).replace("password", "")


@pytest.mark.parametrize(
    "query",
    ["ssl%5Fcert%5Freqs=none", "ssl_cert_reqs=%6Eone", "ssl_check_hostname=%66alse",
     "ssl%5Fcheck%5Fhostname=no"],
)  # fmt: skip
def test_tls_warnings_read_options_as_redis_py_does(query: str) -> None:
    """redis-py decodes a query option's name and value (``ssl%5Fcert%5Freqs=%6Eone`` turns
    verification off): on 6005d89 neither spelling was warned of."""
    from celery_dlock.core.urls import tls_warnings

    assert len(tls_warnings([f"rediss://127.0.0.1:1/0?{query}"])) == 1


def test_tls_warnings_cover_every_tls_scheme_and_option() -> None:
    from celery_dlock.core.urls import tls_warnings

    off = [
        "rediss://:pw@h:6380/0?ssl_cert_reqs=none",
        "rediss+sentinel://h:26379/m/0?ssl_check_hostname=false",
        "rediss+cluster://h:7000?ssl_check_hostname=0",
        "zookeepers://h:2281/x?ssl_cert_reqs=NONE",
    ]
    on = ["rediss://h:6380/0", "redis://h/0?ssl_cert_reqs=none", "zookeepers://h/x?timeout=5"]
    assert len(tls_warnings(off)) == len(off)
    assert tls_warnings(on) == []
    assert "pw" not in " ".join(tls_warnings(off))


def test_dlock_check_warns_of_a_zookeeper_url_without_verification() -> None:
    """The check reads the settings' URLs (a ZooKeeper backend's endpoints drop the query)."""
    from celery import Celery

    from celery_dlock.ops import admin

    app = Celery("zk-tls", set_as_current=False)
    app.conf.dlock_urls = ["zookeepers://u:pw@127.0.0.1:1/x?ssl_cert_reqs=none"]
    report = admin.check(app, reach=False)
    assert report.ok
    assert [w.split(": TLS verification is off")[0] for w in report.warnings] == [
        "zookeepers://u:***@127.0.0.1:1/x?ssl_cert_reqs=none"
    ]


@pytest.mark.local_redis
def test_tls_without_verification_warns_at_worker_start_and_in_dlock_check(
    celery_base: str, wa: Any
) -> None:
    """``ssl_cert_reqs=none`` works (no CA is checked) but the worker's start-up log and
    ``dlock check`` say that verification is off (on c53a04b: not a word, and "ok")."""
    from tests.support.tls import TlsProxy, make_certificates

    certs = make_certificates()
    with RedisServer() as server, TlsProxy(server.port, certs) as proxy:
        url = (
            f"rediss://127.0.0.1:{proxy.port}/0?ssl_cert_reqs=none"
            f"&ssl_certfile={quote(certs.client_cert)}&ssl_keyfile={quote(certs.client_key)}"
        )
        checked = dlock_cli([url], "check")
        env = {
            "DLOCK_TEST_BROKER": with_db(celery_base, 10),
            "DLOCK_TEST_BACKEND": with_db(celery_base, 11),
            "DLOCK_TEST_JOURNAL": with_db(celery_base, 13),
            "DLOCK_TEST_LOCK_URLS": url,
        }
        journal = Journal(env["DLOCK_TEST_JOURNAL"])
        journal.clear()
        worker = Worker(env, journal, name="tls-none", concurrency=1, queue="tls-none").start()
        try:
            sent = wa.drop_task.apply_async(("over-tls",), queue="tls-none")
            assert sent.get(timeout=20) == "over-tls"
        finally:
            worker.stop()
    said = "TLS verification is off (ssl_cert_reqs=none: the server's certificate and host name"
    assert checked.returncode == 0, checked.stderr
    assert said in checked.stderr
    assert checked.stdout.rstrip().endswith("ok")
    assert said in worker.log()


# -- the hostile-input suite: any argument, any password --------------------------------------

#: Examples per property (hypothesis); each key example also takes a real lock on Redis.
KEY_EXAMPLES = 300
URL_EXAMPLES = 500

#: Text from every Unicode category, lone surrogates (Cs) included.
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
#: Text made of what key formats use as separators, hash tags, globs, escapes, controls.
SEPARATORS = st.text(st.sampled_from(list(":{}%*?[]\\/.~-_ \x00\n\r\t\x1b\x7f\u202e\ud800")))
VALUES = st.one_of(st.none(), ANY_TEXT, SEPARATORS, st.sampled_from(["None", "True", "False"]))


def hash_tag(redis_key: str) -> str:
    """What Redis Cluster hashes: the text between the first '{' and the next '}' when not
    empty, else the whole key."""
    start = redis_key.find("{")
    end = redis_key.find("}", start + 1) if start >= 0 else -1
    return redis_key[start + 1 : end] if start >= 0 and end > start + 1 else redis_key


def keyed(builder: Any, args: tuple[Any, ...]) -> str | ConfigError:
    try:
        return str(builder(args, {}))
    except ConfigError as exc:
        return exc


def test_filled_keys_are_distinct_printable_and_valid_everywhere(single_urls: list[str]) -> None:
    """For any two argument pairs of ``meta:{source}:{entity}`` (every Unicode category,
    separators, braces, globs, controls, NUL, lone surrogates, "None"): distinct pairs fill
    distinct keys; each key escapes to printable text (distinct for distinct keys), keeps its
    lock's Redis keys in one Cluster slot under its own tag, makes a valid ZooKeeper node
    name, and takes a real lock on Redis; or the pair is refused with a ConfigError naming
    the argument that holds a lone surrogate."""
    from celery_dlock.backends.zookeeper.nodes import key_name
    from celery_dlock.celery.keys import KeyBuilder
    from celery_dlock.core.registry import manager_for
    from celery_dlock.ops.cli import printable

    def collect(source: Any, entity: Any) -> None: ...

    builder = KeyBuilder("t", collect, "meta:{source}:{entity}")
    manager = manager_for(single_urls)
    counts = {"examples": 0, "refused": 0, "locked": 0}

    @settings(max_examples=KEY_EXAMPLES, deadline=None, database=None)
    @given(first=st.tuples(VALUES, VALUES), second=st.tuples(VALUES, VALUES))
    def check(first: tuple[Any, Any], second: tuple[Any, Any]) -> None:
        counts["examples"] += 1
        one, two = keyed(builder, first), keyed(builder, second)
        for pair, key in ((first, one), (second, two)):
            if isinstance(key, ConfigError):
                named = (
                    "source"
                    if any("\ud800" <= c <= "\udfff" for c in pair[0] or "")
                    else ("entity")
                )
                assert f"argument {named!r} holds a lone surrogate" in str(key)
                counts["refused"] += 1
                continue
            key.encode()  # valid UTF-8 for any store
            shown = printable(key)
            assert shown.isprintable()
            redis_keys = manager.redis_keys(key)
            tags = {hash_tag(k) for k in redis_keys} | {hash_tag(redis_keys[0] + ":void:x")}
            assert tags == {key}, (key, tags)  # its own tag, for the lock and all its keys
            assert len({key_slot(k.encode()) for k in redis_keys}) == 1
            name = key_name(key)
            assert name.isascii(), name
            assert "/" not in name
            assert name not in (".", "..")
        if isinstance(one, str) and isinstance(two, str):
            assert (one == two) == (first == second), (first, second, one, two)
            assert (printable(one) == printable(two)) == (one == two)
            with lock(single_urls, one, ttl=5):  # a real round trip
                counts["locked"] += 1

    check()
    assert counts["examples"] >= KEY_EXAMPLES, counts
    assert counts["refused"] > 0, counts  # lone surrogates were tried
    assert counts["locked"] > KEY_EXAMPLES // 2, counts


def test_a_one_megabyte_argument_gives_a_short_distinct_key() -> None:
    from celery_dlock.celery.keys import KeyBuilder

    def collect(source: Any, entity: Any) -> None: ...

    builder = KeyBuilder("t", collect, "meta:{source}:{entity}")
    big, bigger = "x" * 2**20, "x" * 2**20 + "y"
    one, two = builder((big, "e"), {}), builder((bigger, "e"), {})
    assert one != two
    assert len(one) < 200
    assert len(two) < 200


@pytest.mark.parametrize("key", ["}x", "}"])
def test_a_key_that_would_empty_its_hash_tag_is_refused(key: str) -> None:
    with pytest.raises(ConfigError, match="starts with '}'"):
        lock(["redis://127.0.0.1:1/0"], key).acquire()


#: A password: a marker each end (no URL here holds 'Q' or 'Z') around any printable ASCII,
#: every reserved character included.
PASSWORDS = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="QZ"),
    min_size=1,
    max_size=12,
).map(lambda text: f"Q{text}Z")


def test_no_password_is_ever_printed_in_any_url_form() -> None:
    """For any password, raw or percent-encoded, in every scheme and place: ``redact`` never
    shows it whole, and the settings either take the URL or refuse it without showing it."""

    tried: list[str] = []

    @settings(max_examples=URL_EXAMPLES, deadline=None, database=None)
    @given(secret=PASSWORDS, encoded=st.booleans())
    def check(secret: str, encoded: bool) -> None:
        tried.append(secret)
        written = quote(secret, safe="") if encoded else secret
        for url in url_forms(written):
            assert secret not in redact(url), url
            assert written not in redact(url), url
            error = ""
            try:
                Settings(urls=(url,))
            except ConfigError as exc:
                error = str(exc)
            assert secret not in error, (url, error)
            assert written not in error, (url, error)

    check()
    assert len(tried) >= URL_EXAMPLES  # each in 11 URL forms
