"""A worker that crashes holding a key: on the in-process store (``memory://``) leases run
on ``time.monotonic()``, which freezegun moves, so the ttl passes without waiting for it."""

from __future__ import annotations

import os

import pytest
from freezegun import freeze_time
from shop.tasks import recount_stock

pytestmark = pytest.mark.skipif(
    os.environ.get("SHOP_LOCKS") == "redis",
    reason="a Redis server's ttl runs on its own clock, which freezegun does not move",
)


def test_a_crashed_workers_key_frees_after_its_ttl(dlock):
    with freeze_time("2026-03-01 09:00:00") as clock:
        crashed = dlock.hold("stock:sku-3", ttl=30)
        dlock.crash(crashed)  # no more renewals, never released
        clock.tick(29)
        assert recount_stock.apply(args=("sku-3",)).result["dlock_dropped"]
        clock.tick(2)  # past the ttl
        token = recount_stock.apply(args=("sku-3",)).get()
        assert token > crashed.token  # the stock table refuses the crashed worker's writes
