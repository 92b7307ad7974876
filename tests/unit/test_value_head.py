"""Value heads (``celery_dlock.core.holder``) on their own: the nonce a head opens with, which a
lock cycle reads once at acquire and once at release without searching for it when it was
drawn here (issue 35), and the same answer as a search for any other head."""

from __future__ import annotations

import string

from hypothesis import example, given
from hypothesis import strategies as st

from celery_dlock.backends.redis.ending import owner_prefix
from celery_dlock.core.holder import head_nonce, value_head

NONCES = st.text(alphabet=string.ascii_letters + string.digits + "-_", max_size=60)
OPENING = '{"token":"'


def _searched(head: str) -> str:
    """What head_nonce answered before issue 35: everything up to the first quote."""
    return head[len(OPENING) : head.index('"', len(OPENING))]


@given(nonce=NONCES, rest=st.text(max_size=80))
# A shorter nonce whose value has a quote where a drawn nonce's closing quote would be.
@example(nonce="a" * 20, rest='bbbbbb"holder":null')
@example(nonce="a" * 27, rest="")
@example(nonce="", rest='"')
def test_the_nonce_is_what_opens_the_head_whatever_its_length(nonce: str, rest: str) -> None:
    head = OPENING + nonce + '"' + rest
    assert head_nonce(head) == nonce == _searched(head)
    assert owner_prefix(head, nonce) == OPENING + nonce + '"'


def test_the_heads_this_library_writes() -> None:
    for holder, queued, task in [
        (None, False, None),
        ("t-1", True, "app.task"),
        ('é"', False, "x"),
    ]:
        head = value_head(holder, queued=queued, task=task)
        nonce = head_nonce(head)
        assert len(nonce) == 27
        assert nonce == _searched(head)
        assert owner_prefix(head, nonce) == head[: head.index('"', len(OPENING)) + 1]
