"""The shop's tasks: a per-SKU stock recount (never two at once for one SKU) and a nightly
report that beat sends (once per run however many beat processes there are)."""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task

from celery_dlock import SingletonTask
from celery_dlock.compat import QueueOnce


@shared_task(base=SingletonTask, bind=True, lock_key="stock:{sku}", lock_ttl=30)
def recount_stock(self: Any, sku: str, pause: float = 0.0) -> int:
    """Recount one SKU's stock; ``pause`` plays a slow warehouse API. Returns the fencing
    token, which the stock table would store to refuse older writers."""
    end = time.monotonic() + pause
    while time.monotonic() < end:
        self.lease.ensure()  # before each write to the stock table: still ours?
        time.sleep(0.01)
    return int(self.lease.token)


@shared_task(base=SingletonTask, bind=True)
def nightly_report(self: Any) -> str:
    """Beat sends it; a second beat's send of the same run is dropped."""
    return f"report {self.request.id}"


@shared_task(base=QueueOnce, once={"graceful": False})
def send_invoice(order_id: int) -> str:
    """A task still on celery-once's interface (``celery_dlock.compat.QueueOnce``)."""
    return f"invoice {order_id}"
