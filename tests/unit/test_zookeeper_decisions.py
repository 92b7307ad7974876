"""The ZooKeeper backend's pure decisions (zookeeper/decisions.py, nodes.py, the
endpoints of inspection.py): given names, listings and stats already read, no server."""

from __future__ import annotations

import json

from kazoo.exceptions import BadVersionError, NoNodeError
from kazoo.protocol.states import ZnodeStat

from celery_dlock.backends.zookeeper import decisions
from celery_dlock.backends.zookeeper.decisions import ADOPT, GONE, REFUSE, WAIT, WON
from celery_dlock.backends.zookeeper.inspection import endpoints
from celery_dlock.backends.zookeeper.nodes import (
    expires_ms,
    in_line,
    key_name,
    order_of,
    parse_name,
    prefix,
    task_hash,
    timed_data,
)
from celery_dlock.backends.zookeeper.url import parse


def stat(*, czxid: int = 1, ctime: int = 0, version: int = 0, pzxid: int = 0) -> ZnodeStat:
    """A node's stat as kazoo returns it (the fields these decisions read)."""
    return ZnodeStat(czxid, czxid, ctime, ctime, version, 0, 0, 0, 0, 0, pzxid)


def child(
    nonce: str, seq: int, *, timed: bool = False, task: str | None = None, order: int | None = None
) -> str:
    """A child's name as ZooKeeper makes it: our prefix plus its 10-digit sequence number."""
    return f"{prefix(nonce, timed=timed, task=task, order=order)}{seq:010d}"


# -- names ------------------------------------------------------------------------------------


def test_a_key_is_one_node_name() -> None:
    assert key_name("a/b c") == "a%2Fb%20c"
    assert key_name(".") == "%2E"
    assert key_name("..") == "%2E%2E"
    assert key_name("a.b") == "a.b"


def test_names_parse_back_to_what_made_them() -> None:
    plain = parse_name(child("n1", 42))
    assert plain is not None
    fields = (plain.nonce, plain.seq, plain.order, plain.timed, plain.task)
    assert fields == ("n1", 42, 42, False, None)
    queued = parse_name(child("n2", 43, task="task-1", order=7))
    assert queued is not None
    assert (queued.nonce, queued.seq, queued.order, queued.timed) == ("n2", 43, 7, True)
    assert queued.task == task_hash("task-1")
    assert parse_name("lock-123") is None  # not ten digits
    assert parse_name("n1~x-0000000001") is None  # a flag this module never writes


def test_a_replacement_sorts_where_the_node_it_replaced_was() -> None:
    first, second = child("a", 1), child("b", 2)
    replacement = child("c", 3, timed=True, order=order_of(first))
    line = in_line([second, replacement, "not-ours", first])
    # The replacement and the replaced node share an order; the replaced one is gone in the
    # same transaction, so in a real listing only the replacement holds that place.
    assert [n.name for n in line] == [first, replacement, second]
    assert order_of(replacement) == 1


def test_expiry_counts_from_the_anchor_or_the_creation() -> None:
    data = json.dumps({"token": "n", "ttl": 1500}).encode()
    assert expires_ms(data, stat(ctime=10_000), 60.0) == 11_500
    anchored = timed_data(json.dumps({"token": "n", "holder": None}), 2.0, 4_000)
    assert expires_ms(anchored, stat(ctime=10_000), 60.0) == 6_000
    assert expires_ms(timed_data(anchored.decode(), 2.0, None), stat(ctime=10_000), 60.0) == 12_000
    # unreadable data: the default ttl from ctime, rounded up to whole ms
    assert expires_ms(b"{not json", stat(ctime=10_000), 0.0015) == 10_002


# -- admission --------------------------------------------------------------------------------


def test_first_in_line_wins() -> None:
    mine = child("me", 1)
    step = decisions.admission(in_line([mine, child("b", 2)]), mine, None, out_of_time=True)
    assert step == (WON, 0, None)


def test_our_node_missing_from_the_line_is_gone() -> None:
    step = decisions.admission(in_line([child("a", 1)]), child("me", 2), None, False)
    assert step.kind == GONE


def test_a_waiter_watches_the_node_just_ahead() -> None:
    names = [child("a", 1), child("b", 2), child("me", 3)]
    step = decisions.admission(in_line(names), names[2], None, out_of_time=False)
    assert step.kind == WAIT
    assert step.position == 2
    assert step.node is not None
    assert step.node.name == names[1]


def test_out_of_time_behind_another_holder_is_a_refusal_naming_the_head() -> None:
    names = [child("a", 1), child("b", 2), child("me", 3)]
    step = decisions.admission(in_line(names), names[2], task_hash("t"), out_of_time=True)
    assert step.kind == REFUSE
    assert step.node is not None
    assert step.node.name == names[0]


def test_our_own_queued_lock_first_in_line_is_adopted_even_out_of_time() -> None:
    queued = child("q", 1, task="task-1")
    mine = child("me", 2)
    step = decisions.admission(in_line([mine, queued]), mine, task_hash("task-1"), True)
    assert step.kind == ADOPT
    assert step.node is not None
    assert step.node.name == queued
    other = decisions.admission(in_line([mine, queued]), mine, task_hash("task-2"), False)
    assert other.kind == WAIT


# -- fencing ----------------------------------------------------------------------------------


def test_token_is_the_parents_birth_plus_the_seq_until_a_replacement_then_the_cversion() -> None:
    listed = stat(version=0, ctime=1_700_000_000_123)._replace(cversion=90)
    assert decisions.birth(listed) == 1_700_000_000_123_000  # µs, the Redis tokens' scale
    assert decisions.birth(None) == 0
    assert decisions.marks(listed, seq=100) == (101, False)  # listed after our create
    assert decisions.marks(listed._replace(version=2, cversion=120), seq=100) == (120, True)
    assert decisions.marks(None, seq=100) == (101, False)
    assert decisions.token(birth=10**15, replaced=False, count=120, seq=100) == 10**15 + 100
    assert decisions.token(birth=10**15, replaced=True, count=120, seq=100) == 10**15 + 120
    assert decisions.adopted(10**15, 130) == 10**15 + 131


def test_only_the_second_in_line_of_a_never_replaced_key_skips_the_listing() -> None:
    assert decisions.may_skip_listing(1, replaced=False)
    assert not decisions.may_skip_listing(1, replaced=True)
    assert not decisions.may_skip_listing(2, replaced=False)
    assert decisions.admitted_by_deletion(True, True, True, False)
    assert not decisions.admitted_by_deletion(False, True, True, False)
    assert not decisions.admitted_by_deletion(True, False, True, False)  # a change: list again
    assert not decisions.admitted_by_deletion(True, True, False, False)  # stale proof
    assert not decisions.admitted_by_deletion(True, True, True, True)  # our node was deleted


# -- replies ----------------------------------------------------------------------------------


def test_a_transaction_failed_when_any_result_is_an_error() -> None:
    error = NoNodeError()
    assert decisions.failed(["/p/n-0000000001", stat(), None]) is None
    assert decisions.failed(["/p/n-0000000001", BadVersionError(), error]) is not None
    assert decisions.failed([error]) is error


def test_a_server_serves_when_srvr_shows_its_mode() -> None:
    assert decisions.serving(b"Zookeeper version: 3.8\nMode: standalone\n") is None
    assert decisions.serving(b"This ZooKeeper instance is not currently serving requests\n") == (
        "This ZooKeeper instance is not currently serving requests"
    )
    assert decisions.serving(b"") == "no answer"


def test_endpoints_hide_the_password_and_bracket_ipv6() -> None:
    url = parse("zookeeper://bob:secret@h1:2181,[::1]:2182/jobs")
    assert endpoints(url, "/jobs/dlock") == [
        "zookeeper://bob:***@h1:2181/jobs/dlock",
        "zookeeper://bob:***@[::1]:2182/jobs/dlock",
    ]
