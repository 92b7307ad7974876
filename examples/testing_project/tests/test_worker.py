"""An embedded worker (``dlock_worker``: threads of this process) runs the tasks as a real
worker does: sent through the broker, the lock taken around the body, renewed, lost."""

from __future__ import annotations

import pytest
from shop.tasks import recount_stock

from celery_dlock import LockLost


def test_two_skus_recount_in_parallel(dlock_worker, dlock):
    first = recount_stock.delay("sku-a", pause=3)
    second = recount_stock.delay("sku-b", pause=3)
    # Both keys held at one moment: the two bodies ran at the same time.
    dlock.wait_until(
        lambda: dlock.holder("stock:sku-a") and dlock.holder("stock:sku-b"),
        timeout=3,
        what="both SKUs recounting at once",
    )
    assert first.get(timeout=10) != second.get(timeout=10)


def test_one_sku_never_twice_at_once(dlock_worker, dlock):
    running = recount_stock.delay("sku-c", pause=2)
    dlock.wait_held("stock:sku-c")
    duplicate = recount_stock.delay("sku-c")
    assert duplicate.get(timeout=10)["holder"] == running.id
    assert isinstance(running.get(timeout=10), int)


def test_losing_the_lease_stops_the_body(dlock_worker, dlock):
    result = recount_stock.delay("sku-d", pause=30)
    dlock.wait_held("stock:sku-d")
    dlock.lose("stock:sku-d")  # an operator's forced release, say
    with pytest.raises(LockLost):
        result.get(timeout=10)
