"""The drop-in classes lock on ``dlock_urls`` too, so the same fixtures serve them."""

from __future__ import annotations

import pytest
from shop.tasks import send_invoice

from celery_dlock.compat import AlreadyQueued


@pytest.mark.celery(task_always_eager=True)  # celery_app's settings for this test
def test_a_held_invoice_is_refused_as_celery_once_refuses_it(dlock):
    with dlock.hold(dlock.key(send_invoice, 42)), pytest.raises(AlreadyQueued):
        send_invoice.delay(42)
    assert send_invoice.delay(42).get() == "invoice 42"
