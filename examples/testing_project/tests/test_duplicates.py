"""Eager runs (``.apply()``): the lock is taken in this process, as a worker would take it."""

from __future__ import annotations

from shop.tasks import recount_stock


def test_a_duplicate_is_dropped(dlock):
    with dlock.hold(dlock.key(recount_stock, "sku-1")):  # another worker recounts sku-1
        dropped = recount_stock.apply(args=("sku-1",))
    assert dropped.result["dlock_dropped"] is True
    assert dropped.result["holder"] == "another-worker"
    assert isinstance(recount_stock.apply(args=("sku-1",)).get(), int)  # free again: it runs


def test_another_sku_is_not_held_up(dlock):
    with dlock.hold("stock:sku-1"):
        assert isinstance(recount_stock.apply(args=("sku-2",)).get(), int)
