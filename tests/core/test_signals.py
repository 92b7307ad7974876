"""The lock_released signal: sent once per release, naming the lease, whether anyone listens."""

from __future__ import annotations

from typing import Any

from celery_dlock import lock, lock_released


def test_a_release_sends_lock_released_with_its_lease(single_urls: list[str]) -> None:
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    lock_released.connect(receiver, weak=False)
    try:
        with lock(single_urls, "signalled", ttl=10) as lease:
            token = lease.token
        lock(single_urls, "signalled", ttl=10, wait=0).acquire().release(wait=False)
    finally:
        lock_released.disconnect(receiver)
    assert [(e["key"], e["confirmed"]) for e in seen] == [("signalled", True), ("signalled", None)]
    assert seen[0]["token"] == token
    assert seen[1]["token"] > token
    assert all(e["held_for"] >= 0 for e in seen)
