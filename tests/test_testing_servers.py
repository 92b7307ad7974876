"""celery_dlock.testing's RedisServer: a started server is the process it started."""

from __future__ import annotations

import pytest

from celery_dlock.testing import RedisServer


def test_a_port_another_server_holds_fails_the_start_naming_the_port() -> None:
    # Two free-port picks can return the same port. The second redis-server then fails to bind,
    # while the first answers its PING: the start used to return as if the second were up.
    first = RedisServer().start()
    second = RedisServer(port=first.port)
    try:
        with pytest.raises(RuntimeError, match=rf"redis-server on port {first.port} exited"):
            second.start()
        assert first.ping()
    finally:
        second.stop()
        first.stop()


def test_a_server_asking_for_a_password_is_taken_as_started() -> None:
    server = RedisServer(extra_args=["--requirepass", "pw"]).start()
    try:
        assert server.running
    finally:
        server.stop()
