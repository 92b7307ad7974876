"""The shop's test settings: celery-dlock's plugin (loaded by pytest on its own) gives the
``dlock_*`` fixtures, pytest-celery gives ``celery_app`` and ``celery_config``."""

from __future__ import annotations

import os
from typing import Any

import pytest


@pytest.fixture(scope="session")
def dlock_urls(request: pytest.FixtureRequest) -> list[str]:
    """The in-process lock store (no server), or the plugin's throwaway Redis when
    SHOP_LOCKS=redis (CI runs both)."""
    if os.environ.get("SHOP_LOCKS") == "redis":
        return [request.getfixturevalue("dlock_redis_url")]
    return ["memory://"]


@pytest.fixture(scope="session")
def celery_config(dlock_celery_config: dict[str, Any]) -> dict[str, Any]:
    """An in-memory broker and result store, and the lock store of ``dlock_urls``."""
    return {
        "broker_url": "memory://",
        "result_backend": "cache+memory://",
        **dlock_celery_config,
    }


@pytest.fixture(autouse=True)
def _current_app(celery_app: Any) -> None:
    """Make ``celery_app`` the app the shop's ``shared_task``s resolve to. celery_app is not
    made current by Celery's fixture, and pytest-celery 1.x creates an app of its own when
    pytest starts (its Docker worker's), which would otherwise be the current one. (Both
    are put back after the test.)"""
    celery_app.set_default()
    celery_app.set_current()
