"""The Redis backend's decisions from replies already read (redis/decisions.py): no Redis."""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_dlock.backends.redis import decisions
from celery_dlock.backends.redis.decisions import ABSENT, EXTENDED, RETAKEN, REVOKED, TAKEN
from celery_dlock.backends.redis.inspection import holder_of
from celery_dlock.backends.redis.transport import CoolingDown
from celery_dlock.core.holder import Holder, value_head


def with_length(raw: bytes, pttl: int) -> tuple[bytes, int, int]:
    """An acquire reply's (value, pttl, length) for a value sent whole."""
    return raw, pttl, len(raw)


def value(head: str, fence: int) -> bytes:
    """A lock value as a node stores it: the head the client sent plus that node's fence."""
    return f"{head}{fence}}}".encode()


# -- identity --------------------------------------------------------------------------------


def test_identity_of_a_value_this_library_wrote() -> None:
    head = value_head("task-1", task="proj.collect")
    ident = decisions.identity(value(head, 7))
    assert ident.holder is not None
    assert ident.nonce == ident.holder.nonce
    assert len(ident.nonce) >= 26
    assert ident.task_id == "task-1"
    assert ident.raw is None
    assert ident.holder.fence == 7
    assert ident.holder.task == "proj.collect"


def test_identity_of_a_foreign_value_is_the_raw_value() -> None:
    ident = decisions.identity(b"locked-by-someone-else")
    assert ident == decisions.Identity(None, None, None, b"locked-by-someone-else")


# -- refusal ---------------------------------------------------------------------------------


def test_refusal_too_few_answers_is_unavailable() -> None:
    errors = [("redis://a", "ConnectionError: refused"), ("redis://b", "TimeoutError: slow")]
    head = value_head("t")
    refusal = decisions.refusal([with_length(value(head, 3), 900)], errors, (2,), nodes=3, quorum=2)
    assert refusal.unavailable
    assert not refusal.split
    assert refusal.holder is None
    assert refusal.detail.startswith("1 of 3 node(s) answered, 2 needed (redis://a: Conn")
    assert refusal.answered == (2,)


def test_refusal_errors_and_no_holder_seen_is_unavailable_even_with_a_quorum_of_answers() -> None:
    # Two of three answered but neither showed a holder (their replies were voided): nothing
    # says the key is held, so "contended" would be a guess.
    errors = [("redis://a", "attempt voided")]
    refusal = decisions.refusal([], errors, (0, 1), nodes=3, quorum=2)
    assert refusal.unavailable


def test_refusal_held_by_one_acquisition_reports_its_highest_fence_and_soonest_expiry() -> None:
    head = value_head("task-9")
    others = [with_length(value(head, 41), 1500), with_length(value(head, 42), 1200)]
    refusal = decisions.refusal(others, [], (0, 1, 2), nodes=3, quorum=2)
    assert not refusal.unavailable
    assert not refusal.split
    assert refusal.detail == "held"
    assert refusal.holder is not None
    assert (refusal.holder.task_id, refusal.holder.fence) == ("task-9", 42)
    assert refusal.retry_after == 1.2


def test_refusal_queued_lock_being_taken_over_groups_by_task_id() -> None:
    # The enqueue-time lock (queued) on one node, its execution's on the other: two nonces,
    # one task, together a majority.
    queued = value_head("task-5", queued=True)
    running = value_head("task-5")
    others = [with_length(value(queued, 10), 800), with_length(value(running, 11), 30000)]
    refusal = decisions.refusal(others, [], (0, 1, 2), nodes=3, quorum=2)
    assert refusal.holder is not None
    assert refusal.holder.task_id == "task-5"
    assert refusal.holder.fence == 11
    assert not refusal.holder.queued
    assert refusal.retry_after == 0.8
    assert not refusal.split


def test_refusal_foreign_value_on_a_majority_is_held_by_nobody_we_know() -> None:
    others = [(b"legacy", 5000, 6), (b"legacy", 4000, 6)]
    refusal = decisions.refusal(others, [], (0, 1), nodes=3, quorum=2)
    assert refusal.detail == "held"
    assert refusal.holder is None
    assert refusal.retry_after == 4.0
    assert refusal.foreign == (b"legacy", 6)


def test_refusal_an_oversized_value_is_foreign_even_if_its_start_parses() -> None:
    """The script sends a long value's start only: never read as this library's."""
    start = value(value_head("t"), 1)
    refusal = decisions.refusal([(start, 5000, 10**8)], [], (0,), nodes=1, quorum=1)
    assert refusal.holder is None
    assert refusal.foreign == (start, 10**8)


def test_refusal_contenders_without_a_majority_is_a_split() -> None:
    others = [with_length(value(value_head(f"t{i}"), i), 1000) for i in range(3)]
    refusal = decisions.refusal(others, [], (0, 1, 2), nodes=5, quorum=3)
    assert refusal.split
    assert refusal.holder is None
    assert refusal.detail == "contended"


def test_refusal_a_value_without_expiry_gives_no_retry_after_to_spin_on() -> None:
    """PTTL -1 (no expiry; issue 31 item 9): no retry_after (it was 0.0, a waiter spun on it),
    and the refusal says the value has no expiry."""
    head = value_head("t")
    refusal = decisions.refusal([with_length(value(head, 1), -1)], [], (0,), nodes=1, quorum=1)
    assert refusal.retry_after is None
    assert refusal.no_expiry


# -- tally -----------------------------------------------------------------------------------


def test_tally_sorts_replies_by_what_each_node_said() -> None:
    replies = [
        [1, b"17"],
        RedisTimeoutError("slow"),
        [0, b"someone", b"2500", 7],
        [2],
        [1, 18],
    ]
    tally = decisions.tally(replies)
    assert tally.fences == {0: 17, 4: 18}
    assert tally.others == [(b"someone", 2500, 7)]
    assert tally.errors == [1, 3]


# -- renewal ---------------------------------------------------------------------------------


def test_renewal_quorum_extended_is_renewed() -> None:
    assert decisions.renewal([EXTENDED, EXTENDED, None], 2, True) == (True, None)


def test_renewal_silent_nodes_that_could_still_make_a_quorum_is_undecided() -> None:
    assert decisions.renewal([EXTENDED, None, TAKEN], 2, True) == (False, None)
    assert decisions.renewal([None], 1, False) == (False, None)


def test_renewal_retakes_do_not_count_toward_the_quorum() -> None:
    verdict = decisions.renewal([EXTENDED, RETAKEN, RETAKEN], 2, True)
    assert not verdict.renewed
    assert verdict.lost is not None
    assert verdict.lost.startswith("the key is gone from Redis on 2")


def test_loss_reason_revoked_wins_over_everything() -> None:
    reason = decisions.loss_reason([TAKEN, TAKEN, REVOKED], True)
    assert reason == "released by an operator (celery dlock release)"


def test_loss_reason_taken_names_the_nodes_on_redlock_only() -> None:
    assert decisions.loss_reason([TAKEN, TAKEN, ABSENT], True) == (
        "another holder has the key on 3 of 3 nodes"
    )
    assert decisions.loss_reason([TAKEN], False) == "another holder has the key"


def test_loss_reason_more_gone_than_taken_is_gone() -> None:
    assert decisions.loss_reason([TAKEN, ABSENT, RETAKEN, None, None], True) == (
        "the key is gone from Redis on 3 of 5 nodes (deleted, expired, or Redis restarted "
        "without its data)"
    )


# -- which nodes may still run a command late ------------------------------------------------


def test_silent_nodes_are_those_sent_a_command_that_never_answered() -> None:
    replies = [1, RedisTimeoutError("slow"), CoolingDown("skipped"), ResponseError("NOSCRIPT")]
    # The cooling-down node was never sent the command, so it cannot run it late; every other
    # exception (an error reply too) counts as silent.
    assert decisions.silent(replies) == frozenset({1, 3})


def test_failed_release_is_one_without_an_answer() -> None:
    assert decisions.failed(RedisConnectionError("reset"))
    assert not decisions.failed(ResponseError("NOPERM"))  # an answer: retrying cannot help
    assert not decisions.failed(1)
    assert not decisions.failed(0)


def test_ms_never_rounds_to_zero() -> None:
    assert decisions.ms(0.0001) == 1
    assert decisions.ms(1.5) == 1500


# -- holder of an inspected key --------------------------------------------------------------


def test_holder_of_needs_one_acquisition_on_a_quorum() -> None:
    head = value_head("task-3")
    other = value_head("task-4")
    assert holder_of([(value(head, 5), 900, b"5"), (value(other, 6), 900, b"6")], 2) is None
    assert holder_of([(None, -2, b"9"), (None, -2, None)], 1) is None


def test_holder_of_takes_the_fence_from_a_counter_when_the_value_carrying_it_is_missing() -> None:
    head = value_head("task-3")
    answered = [(value(head, 5), 900, b"8"), (value(head, 6), 800, b"6")]
    found = holder_of(answered, 2)
    assert isinstance(found, Holder)
    assert (found.task_id, found.fence) == ("task-3", 8)


# -- Holder's older names --------------------------------------------------------------------


def test_holder_older_names_are_aliases() -> None:
    new = Holder("n0nce", "task-1", "h", 7, 1.5, 42)
    old = Holder(token="n0nce", holder="task-1", host="h", pid=7, since=1.5, fence=42)
    assert new == old
    assert (old.token, old.holder) == (old.nonce, old.task_id) == ("n0nce", "task-1")
    assert Holder(**old.as_dict()) == old
    assert old.as_dict()["token"] == "n0nce"
    assert old.as_dict()["holder"] == "task-1"
