"""Every kind of bad input to the lock core gets a clear error that names the problem."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from decimal import Decimal
from typing import Any

import pytest
from celery import Celery

from celery_dlock import ConfigError, DLockConfigWarning, lock
from celery_dlock.core.config import Settings
from celery_dlock.core.urls import redact
from tests.support.clients import client

GOOD = ["redis://127.0.0.1:1/0"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ttl": 0}, "ttl must be > 0 seconds, got 0"),
        ({"ttl": -5}, "ttl must be > 0 seconds, got -5"),
        ({"ttl": math.nan}, "ttl must be > 0 seconds, got nan"),
        ({"ttl": "30"}, "ttl must be a number of seconds, not '30'"),
        ({"ttl": True}, "ttl must be a number of seconds, not True"),
        (
            {"ttl": 3, "renew_interval": 3},
            "renew_interval (3 s) must be shorter than the ttl (3 s) less its drift allowance",
        ),
        ({"ttl": 3, "renew_interval": 9}, "renew_interval (9 s) must be shorter than the ttl"),
        ({"ttl": 3, "renew_interval": 0}, "renew_interval must be > 0 seconds"),
        ({"wait": -1}, "wait must be >= 0 seconds, got -1"),
        ({"max_hold": 0}, "max_hold must be > 0 seconds"),
    ],
)
def test_bad_lock_options(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        lock(GOOD, "k", **kwargs)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


class Seconds(float):
    """A float subclass, as numpy.float64 is: checked as any number is, not passed as is."""


@pytest.mark.parametrize(
    ("wait", "message"),
    [
        (math.nan, "wait must be >= 0 seconds, got nan."),
        (math.inf, "wait must be >= 0 seconds, got inf."),
        (-math.inf, "wait must be >= 0 seconds, got -inf."),
        (-1.0, "wait must be >= 0 seconds, got -1.0."),
        (-5e-324, "wait must be >= 0 seconds, got -5e-324."),
        (Seconds(-1.0), "wait must be >= 0 seconds, got -1.0."),
        (Seconds(math.nan), "wait must be >= 0 seconds, got nan."),
        (True, "wait must be a number of seconds, not True."),
        (False, "wait must be a number of seconds, not False."),
        (Decimal("1.5"), "wait must be a number of seconds, not Decimal('1.5')."),
        ("1", "wait must be a number of seconds, not '1'."),
    ],
)
def test_bad_wait_is_refused_as_it_always_was(wait: Any, message: str) -> None:
    """lock() passes a wait that is a float in [0, inf) without its check: everything else
    still gets the check's error, word for word."""
    with pytest.raises(ConfigError) as info:
        lock(GOOD, "k", wait=wait)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("wait", "kept"),
    [(0.0, 0.0), (-0.0, 0.0), (2.5, 2.5), (1e308, 1e308), (0, 0.0), (3, 3.0), (Seconds(1.5), 1.5)],
)
def test_good_wait_is_kept_as_a_plain_float(wait: Any, kept: float) -> None:
    """Accepted waits become plain floats (an int or float subclass converted), as before."""
    guard = lock(GOOD, "k", wait=wait)
    assert type(guard._wait) is float
    assert guard._wait == kept
    assert f"wait={float(wait)}" in repr(guard)


def test_key_must_be_a_string() -> None:
    with pytest.raises(TypeError, match=r"lock key must be a str, not int \(42\)"):
        lock(GOOD, 42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not bytes"):
        lock(GOOD, b"k")  # type: ignore[arg-type]


def test_key_must_be_non_empty_and_bounded() -> None:
    with pytest.raises(ConfigError, match="lock key is empty"):
        lock(GOOD, "")
    with pytest.raises(ConfigError, match="2000 characters, over the 1024 limit; hash"):
        lock(GOOD, "x" * 2000)


@pytest.mark.parametrize(
    ("urls", "message"),
    [
        ([], "dlock_urls is empty: give one URL (redis://host:6379/0, or one zookeeper://"),
        (["http://host:6379"], "has scheme 'http'; use redis://host:6379/0"),
        (["redis://a:1,b:2/0"], "lists several hosts in one URL"),
        (["redis+sentinel://a:26379,b:26379"], "names no Sentinel service"),
        (["redis+sentinel://a:x/mymaster"], "has port 'x', which is not a number"),
        (["redis+sentinel://a/mymaster/zero"], "the path may hold only a database number"),
        (["redis+cluster://a:7000/2"], "Redis Cluster has only database 0"),
        (["redis+cluster://a:x,b:7001"], "has port 'x', which is not a number"),
        (["redis+cluster://a:7000,"], "has an empty host in its host list"),
        (
            ["redis+cluster://a:7000,b:7001", "redis://c", "redis://d"],
            "'redis+cluster://a:7000,b:7001' is a Redis Cluster, which is one lock node; give it "
            "as the only dlock_urls entry",
        ),
        (
            ["redis+sentinel://a,b/m/0", "redis+sentinel://b,a/m/1", "redis://c"],
            "name the same Redis server",
        ),
        (["redis://"], "names no host"),
        (["redis://h:port/0"], "port that is not a number"),
        (["redis://h:6379/zero"], "database 'zero'; the path must be a number"),
        (["unix://"], "names no socket path"),
        (
            ["rediss://u:pw@h:6380/0?ssl_ca_certs=/nonexistent/ca.pem"],
            "'rediss://u:***@h:6380/0?ssl_ca_certs=/nonexistent/ca.pem': "
            "ssl_ca_certs='/nonexistent/ca.pem' is not a file; give the path of a PEM file",
        ),
        (["rediss://h/0?ssl_certfile=/no/client.crt"], "ssl_certfile='/no/client.crt' is not"),
        ([42], "42 is a int, not a URL string"),
        # Unhashable entries: the known-list lookup (a tuple key) must not hide the check's error.
        ([{"url": "redis://h"}], "dlock_urls: {'url': 'redis://h'} is a dict, not a URL string"),
        ([["redis://h"]], "dlock_urls: ['redis://h'] is a list, not a URL string"),
        (
            {"redis://h"},
            "needs a Celery app or a list of lock-store URLs as its first argument, not set",
        ),
        (
            ["redis://a:1/0", "redis://a:1/3", "redis://b:1/0"],
            "'redis://a:1/3' and 'redis://a:1/0' name the same Redis server",
        ),
        (
            ["redis://a:1", "redis://b:1"],
            "two URLs: a Redlock quorum is 2 of 2, so losing either node stops every lock; "
            "it survives no failure",
        ),
        (
            ["zookeeper://127.0.0.1:1/x", "redis://h:6379"],
            "dlock_urls mixes kinds of lock store ('zookeeper://127.0.0.1:1/x', "
            "'redis://h:6379'): every URL of one list must name the same kind",
        ),
        (
            ["zookeeper://a:1/x", "zookeeper://b:1/x"],
            "dlock_urls has 2 ZooKeeper URLs ('zookeeper://a:1/x', 'zookeeper://b:1/x'): one URL "
            "names a whole ensemble; list its servers in that one URL",
        ),
        (["zookeper://a:1/x"], "has scheme 'zookeper'; did you mean 'zookeeper'?"),
        (["zookeeper://u:pw@a:0/x"], "'zookeeper://u:***@a:0/x': port 0 of 'a:0' is out of range"),
    ],
)
def test_bad_urls(urls: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        lock(urls, "k")
    assert message in str(info.value)


def test_a_zookeeper_url_without_kazoo_names_the_setting_and_the_extra() -> None:
    """Without kazoo, a zookeeper:// URL is refused when the settings are read, naming the
    setting, the URL and the pip extra (run in a child where kazoo cannot be imported)."""
    code = (
        "import sys; sys.modules['kazoo'] = None\n"  # import kazoo -> ModuleNotFoundError
        "from celery import Celery\n"
        "from celery_dlock import ConfigError, lock\n"
        "app = Celery('a')\n"
        "app.conf.dlock_urls = ['zookeeper://u:pw@127.0.0.1:1/x']\n"
        "try:\n"
        "    lock(app, 'k')\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.stdout.strip() == (
        "dlock_urls ('zookeeper://u:***@127.0.0.1:1/x') needs the Python package 'kazoo', "
        "which is not installed; install it: pip install 'celery-dlock[zookeeper]'."
    ), done.stderr


def test_passwords_never_appear_in_errors() -> None:
    with pytest.raises(ConfigError) as info:
        lock(["redis://:s3cret@a:1/0", "redis://:s3cret@a:1/1", "redis://b:1"], "k")
    assert "s3cret" not in str(info.value)
    assert "redis://:***@a:1/1" in str(info.value)
    assert redact("rediss://user:pw@h:6380/2") == "rediss://user:***@h:6380/2"
    assert (
        redact("redis+sentinel://:pw@a:1,b:2/m/0?sentinel_password=spw&ssl_certfile=/c")
        == "redis+sentinel://:***@a:1,b:2/m/0?sentinel_password=***&ssl_certfile=/c"
    )


def test_cluster_passwords_never_appear_in_errors() -> None:
    with pytest.raises(ConfigError) as info:
        lock(["redis+cluster://:s3cret@a:7000,b:7001", "redis://c", "redis://d"], "k")
    assert "s3cret" not in str(info.value)
    assert "redis+cluster://:***@a:7000,b:7001" in str(info.value)


def test_an_even_node_count_warns_with_its_quorum() -> None:
    urls = [f"redis://h{i}:6379" for i in range(4)]
    with pytest.warns(DLockConfigWarning, match="4 nodes: the quorum is 3, which tolerates 1"):
        Settings(urls=tuple(urls))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Settings(urls=tuple(urls[:3]))


def test_app_without_redis_anywhere() -> None:
    app = Celery("t", set_as_current=False, broker="amqp://guest@localhost//")
    with pytest.raises(ConfigError, match=r"dlock_urls is not set and the broker is not Redis"):
        lock(app, "k")


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("dlock_ttl", -1, "dlock_ttl must be > 0 seconds"),
        ("dlock_node_timeout", 0, "dlock_node_timeout must be > 0 seconds"),
        ("dlock_drift_factor", 0.7, "dlock_drift_factor must be a fraction in [0, 0.5)"),
        ("dlock_prefix", "", "dlock_prefix must be a non-empty string"),
        ("dlock_prefix", "a{b", "without '{'"),
    ],
)
def test_bad_settings(setting: str, value: Any, message: str) -> None:
    app = Celery("t", set_as_current=False)
    app.conf.dlock_urls = GOOD
    app.conf[setting] = value
    with pytest.raises(ConfigError) as info:
        lock(app, "k")
    assert message in str(info.value)


def test_first_argument_must_be_app_or_urls() -> None:
    with pytest.raises(ConfigError, match="needs a Celery app or a list of lock-store URLs"):
        lock(3.5, "k")


def test_renew_interval_must_leave_room_for_the_drift_allowance() -> None:
    with pytest.raises(ConfigError, match=r"renew_interval \(0.995 s\) must be shorter"):
        lock(GOOD, "k", ttl=1, renew_interval=0.995)
    with pytest.warns(DLockConfigWarning, match="over half the ttl"):
        lock(GOOD, "k", ttl=1, renew_interval=0.6)


def test_ttl_must_outlast_its_drift_allowance() -> None:
    with pytest.raises(ConfigError, match=r"ttl \(0.005 s\) is too short"):
        lock(GOOD, "k", ttl=0.005)


# -- the whole table: what a user gets for each kind of bad input at run time -------------------


def runtime_error(urls: list[str], key: str = "report") -> str:
    from celery_dlock import lock

    try:
        with lock(urls, key, ttl=5):
            pass
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("no error")


@pytest.mark.local_redis
def test_runtime_bad_input_table() -> None:
    from celery_dlock.backends.redis.diagnose import acl_rules
    from celery_dlock.testing import RedisServer, free_port
    from tests.support.tls import TlsProxy, make_certificates, tls_url

    down = f"redis://127.0.0.1:{free_port()}/0"
    certs = make_certificates()
    with (
        RedisServer(extra_args=["--requirepass", "s3cret"]) as guarded,
        TlsProxy(guarded.port, certs) as proxy,
    ):
        wrong = f"redis://:nope@127.0.0.1:{guarded.port}/0"
        missing = f"redis://127.0.0.1:{guarded.port}/0"
        right = f"redis://:s3cret@127.0.0.1:{guarded.port}/0"
        limited = acl_rules().replace(" +evalsha", "")
        client(right).execute_command("ACL", "SETUSER", "nosha", "on", ">s3cret", *limited.split())
        nosha = f"redis://nosha:s3cret@127.0.0.1:{guarded.port}/0"
        to_tls = f"redis://:s3cret@127.0.0.1:{proxy.port}/0"
        no_cert = tls_url(proxy.port, certs, auth=":s3cret", client_cert=False)
        wrong_ca = tls_url(proxy.port, certs, auth=":s3cret", ca=certs.other_ca_file)
        to_plain = tls_url(guarded.port, certs, auth=":s3cret")
        table = {
            "Redis down": (
                runtime_error([down]),
                f"LockUnavailable: cannot lock 'report': 0 of 1 node(s) answered, 1 needed "
                f"({down}: ConnectionError: Error 111 connecting to 127.0.0.1:",
            ),
            "wrong password": (
                runtime_error([wrong]),
                "LockUnavailable: cannot lock 'report': 0 of 1 node(s) answered, 1 needed "
                f"(redis://:***@127.0.0.1:{guarded.port}/0: AuthenticationError: wrong password "
                "or user name in the URL (or the ACL user is disabled))",
            ),
            "no password": (
                runtime_error([missing]),
                f"({missing}: AuthenticationError: the server requires a password; put it in "
                "the URL (redis://:PASSWORD@host:port/db, or redis://USER:PASSWORD@... for an "
                "ACL user))",
            ),
            "oversized key": (
                runtime_error([right], key="k" * 5000),
                "ConfigError: lock key is 5000 characters, over the 1024 limit; hash the "
                "variable part (hashlib.sha256(...).hexdigest()).",
            ),
            "ACL user without a needed command": (
                runtime_error([nosha]),
                "(redis://nosha:***@127.0.0.1:"
                f"{guarded.port}/0: NoPermissionError: ACL user 'nosha' may not run a command "
                "or use a key that celery_dlock needs (this user has no permissions to run the "
                "'evalsha' command or its subcommand); grant them with: ACL SETUSER nosha "
                f"{acl_rules()})",
            ),
            "redis:// to a TLS port": (
                runtime_error([to_tls]),
                "if this port expects TLS, use rediss:// with ssl_ca_certs=",
            ),
            "wrong CA": (
                runtime_error([wrong_ca]),
                "is not signed by a CA this client trusts: add ssl_ca_certs=/path/to/ca.pem",
            ),
            "no client certificate": (
                runtime_error([no_cert]),
                "requires a client certificate it trusts: add ssl_certfile=/path/to/client.crt",
            ),
            "rediss:// to a plain port": (
                runtime_error([to_plain]),
                "no TLS handshake from the server: if this port serves plain Redis, use redis://",
            ),
        }
        for case, (got, expected) in table.items():
            assert expected in got, f"{case}: {got}"
            assert "s3cret" not in got
            assert "nope" not in got


def test_an_unknown_url_option_names_the_likely_one_and_hides_its_value() -> None:
    with pytest.raises(ConfigError) as info:
        lock(["redis://127.0.0.1:1/0?pasword=s3cret"], "k")
    message = str(info.value)
    assert "has query option 'pasword', which redis-py's connections do not take" in message
    assert "Did you mean 'password'?" in message
    assert "s3cret" not in message


def test_a_misspelt_setting_is_refused_not_ignored() -> None:
    app = Celery("t", set_as_current=False, broker="redis://127.0.0.1:1/0")
    app.conf.dlock_url = ["redis://elsewhere:6379/0"]  # would leave the locks on the broker
    with pytest.raises(ConfigError, match="'dlock_url' is not a celery_dlock setting") as info:
        lock(app, "k")
    assert "(did you mean 'dlock_urls'?)" in str(info.value)


@pytest.mark.parametrize(
    ("broker", "expected"),
    [
        ("redis+socket:///tmp/redis.sock", "unix:///tmp/redis.sock"),  # kombu's socket form
        ("redis://", "redis://localhost:6379/0"),  # kombu's default server
    ],
)
def test_kombu_broker_forms_give_the_same_redis_for_locks(broker: str, expected: str) -> None:
    from celery_dlock.core.config import settings_from_app

    app = Celery("t", set_as_current=False, broker=broker)
    assert settings_from_app(app).urls == (expected,)


def test_a_failover_broker_list_asks_for_dlock_urls() -> None:
    app = Celery("t", set_as_current=False, broker="redis://a:6379;redis://b:6380")
    with pytest.raises(ConfigError, match="the broker URL is a failover list"):
        lock(app, "k")


@pytest.mark.parametrize(
    ("option", "suggestion"),
    [({"lock_tll": 5}, "'lock_ttl'"), ({"on_duplicates": "drop"}, "'on_duplicate'")],
)
def test_a_misspelt_task_option_name_is_refused(option: dict[str, Any], suggestion: str) -> None:
    from celery_dlock import SingletonTask

    app = Celery("t", set_as_current=False)
    app.conf.dlock_urls = GOOD
    name = next(iter(option))

    def body(source: str) -> str:
        return source

    task = app.task(base=SingletonTask, shared=False, **option)(body)
    with pytest.raises(ConfigError, match=f"'{name}' is not a SingletonTask option") as info:
        task.name  # noqa: B018 - Celery creates the task class on first use
    assert f"Did you mean {suggestion}?" in str(info.value)


def test_a_bound_tasks_self_is_no_key_argument() -> None:
    from celery_dlock import SingletonTask

    app = Celery("t", set_as_current=False)
    app.conf.dlock_urls = GOOD

    def body(self: Any, source: str) -> str:
        return source

    task = app.task(base=SingletonTask, bind=True, shared=False, lock_key="{self}")(body)
    with pytest.raises(ConfigError, match="names 'self', which the task does not take"):
        task.name  # noqa: B018


def test_a_wrong_beat_ttl_names_its_setting() -> None:
    from celery_dlock.core.config import beat_settings

    app = Celery("t", set_as_current=False)
    app.conf.dlock_beat_ttl = 0
    with pytest.raises(ConfigError, match="dlock_beat_ttl must be > 0 seconds, got 0"):
        beat_settings(app)


@pytest.mark.parametrize(
    ("name", "namespace", "says"),
    [
        ("DLOCK_URLS", None, "setting 'DLOCK_URLS' is ignored: Celery looks for 'dlock_urls'"),
        (
            "CELERY_DLOCK_URLS",
            None,
            "setting 'CELERY_DLOCK_URLS' is ignored: Celery reads CELERY_-prefixed settings "
            "only with config_from_object(..., namespace='CELERY'); without a namespace Celery "
            "looks for 'dlock_urls'",
        ),
        ("celery_dlock_url", "celery", "(did you mean 'celery_dlock_urls'?)"),
        ("dlock_url", "CELERY", "(did you mean 'dlock_urls'?)"),  # set on app.conf itself
    ],
)
def test_a_setting_celery_would_not_read_is_named_as_written(
    name: str, namespace: str | None, says: str
) -> None:
    app = Celery("t", set_as_current=False, broker="redis://127.0.0.1:1/0", namespace=namespace)
    app.conf.update({name: ["redis://elsewhere:6379/0"], "dlock_ttl": 5})
    with pytest.raises(ConfigError) as info:
        lock(app, "k")
    assert says in str(info.value)
    assert str(info.value).count("setting '") == 1, str(info.value)


@pytest.mark.parametrize("namespace", [None, "CELERY", "celery", "Celery", "CELERY_"])
@pytest.mark.parametrize(
    "name",
    [
        "dlock_urls",
        "DLOCK_URLS",
        "celery_dlock_urls",
        "CELERY_DLOCK_URLS",
        "Celery_dlock_urls",
        "CELERY_dlock_urls",
    ],
)
def test_a_setting_name_is_refused_exactly_when_celery_would_not_read_it(
    name: str, namespace: str | None
) -> None:
    """Whatever the namespace's case, the library agrees with Celery itself (its own lookup is
    the judge): a name Celery reads passes, one it ignores is reported."""
    from celery_dlock.core.config import misnamed_settings

    source = type("Config", (), {name: ["redis://127.0.0.1:1/7"]})
    app = Celery("t", set_as_current=False, broker="redis://127.0.0.1:1/0")
    app.config_from_object(source, namespace=namespace)
    celery_reads = app.conf.get("dlock_urls") is not None
    problems = misnamed_settings(app.conf, app.namespace)
    assert (not problems) == celery_reads, (celery_reads, problems)
