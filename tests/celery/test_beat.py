"""Beat with real ``celery beat`` processes, a real worker and real Redis (single instance), and
the same on a real ZooKeeper server.

Each execution of the scheduled task journals its schedule slot (the ``dlock_tick`` header)
and the beat process that sent it (``dlock_beat``); counting per slot shows what ran.
"""

from __future__ import annotations

import itertools
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.celery_fixtures import Mode
from tests.support.workers import Beat, Journal, Worker, intervals, overlaps

pytestmark = [pytest.mark.slow, pytest.mark.local_redis]
#: The lock stores this module's worker and beats run on (tests/conftest.py).
MODES = ["single", "redlock5", "zookeeper"]


@pytest.fixture
def single_only(mode: Mode) -> None:
    """Not on Redlock: beat's behaviour does not depend on the Redis topology (one Redis
    shows it), but it does on the kind of store (ZooKeeper runs it too)."""
    if mode.name == "redlock5":
        pytest.skip("beat behaviour does not depend on the lock topology; shown on one Redis")


@pytest.fixture
def beats(mode: Mode, journal: Journal) -> Iterator[Any]:
    started: list[Beat] = []

    def start(name: str, body: str, scheduler: str | None = None, clock_offset: float = 0) -> Beat:
        env = {**mode.env, "DLOCK_TEST_BEAT": body, "DLOCK_TEST_BEAT_TTL": "3"}
        beat = Beat(env, name=name, scheduler=scheduler, clock_offset=clock_offset).start()
        started.append(beat)
        return beat

    yield start
    for beat in started:
        beat.stop()
        print(f"--- beat {beat.name} log (shown when the test fails):\n{beat.log()}")


def count(entries: list[dict[str, Any]], event: str, **match: Any) -> int:
    return len(
        [e for e in entries if e["event"] == event and all(e.get(k) == v for k, v in match.items())]
    )


#: The longest a span of schedule may take to show its runs on a loaded host: spans are
#: counted in runs (run_until), this only turns "never" into a failure.
SPAN_DEADLINE = 120.0


def run_until(journal: Journal, check: Callable[[list[dict[str, Any]]], bool], what: str) -> None:
    """Let the beats run until the journal shows ``check`` (the span of schedule under test)."""
    journal.wait(check, SPAN_DEADLINE, what)


def settle(journal: Journal, name: str) -> list[dict[str, Any]]:
    """Wait until every execution that started has ended."""
    journal.wait(
        lambda es: (
            len([e for e in es if e["event"] == "start" and e.get("name") == name])
            == len([e for e in es if e["event"] == "end" and e.get("name") == name])
        ),
        15,
        f"{name} executions to end",
    )
    return journal.select("start", name=name)


def slot_of(entry: dict[str, Any]) -> int:
    return int(entry["tick"].rsplit(":", 1)[1])


#: How much later a body may start after its send than another one did (dispatch through the
#: broker and the pool): the spacing of the sends shows in the starts up to this much.
DISPATCH_JITTER = 0.2


def spacing(starts: list[dict[str, Any]]) -> list[float]:
    times = sorted(s["t"] for s in starts)
    return [b - a for a, b in itertools.pairwise(times)]


def test_two_stock_beats_run_every_tick_exactly_once(
    single_only: None, wa: Any, worker: Worker, journal: Journal, beats: Any
) -> None:
    log_from = len(worker.log())
    first = beats("stock-1", "ticks:0")
    second = beats("stock-2", "ticks:0")
    # The span of schedule under test is counted in ticks, not seconds: 18 runs, and 10 second
    # copies dropped (both beats sending). A host slow to start a beat only makes it longer.
    run_until(
        journal,
        lambda es: count(es, "start", name="ticks") >= 18 and count(es, "contended") >= 10,
        "18 ticks run and 10 copies dropped",
    )
    first.stop()
    second.stop()
    starts = settle(journal, "ticks")
    assert starts, "nothing ran"
    # Every tick ran once, whichever beat sent it: each run names its slot (the dlock_tick
    # header, "<entry>:<slot>", the 1 s period its send fell in on a grid shared by both
    # beats), and no slot ran twice. Slots, not start times: a worker slow to take one message
    # (a loaded machine) makes two runs' starts close without any tick having run twice.
    slots = sorted(int(s["tick"].rsplit(":", 1)[1]) for s in starts)
    assert len(set(slots)) == len(slots), f"a tick ran twice: {slots}"
    # None was lost: a stock beat sends a period after its last send, so a late wake-up moves
    # its sends along the grid and can step over one slot, never two.
    steps = [b - a for a, b in itertools.pairwise(slots)]
    assert max(steps) <= 2, f"a tick was lost: {slots}"
    assert len(starts) >= 18, f"only {len(starts)} runs"
    # Both beats did send every tick: the worker dropped the second copy of each.
    senders = {s["beat"] for s in starts}
    dropped = journal.select("contended", policy="drop")
    assert len(senders) == 2 or len(dropped) >= 15, (senders, len(dropped))
    assert len(dropped) >= 10
    # The worker says why: the slot was sent already (no key was held; that run had ended).
    log = worker.log()[log_from:]
    assert log.count("dropped: beat already sent this run of 'every-second' as task ") >= 10
    assert "is held by" not in log


@pytest.mark.skipif(shutil.which("faketime") is None, reason="needs faketime (Debian package)")
@pytest.mark.redis_only(
    "under faketime Python's timed waits never return (threading.Event().wait(1) hangs), and "
    "the ZooKeeper client and its tick-key expiry timer wait so; Redis counts the ttl itself"
)
@pytest.mark.parametrize("offset", [3.0, 45.0])
def test_two_stock_beats_with_skewed_clocks_run_each_period_once(
    single_only: None, wa: Any, worker: Worker, journal: Journal, beats: Any, offset: float
) -> None:
    # The review's case: one beat 3 s ahead, a 6 s interval (here 4 s, to save time); and
    # one far beyond a period. Interval sends follow each beat's own durations, and the tick
    # key's life is a duration Redis counts: the wall clocks' offset does not matter.
    name = f"skew-{offset:g}"
    a = beats(f"{name}-a", f"{name}:0:4")
    b = beats(f"{name}-b", f"{name}:0:4", clock_offset=offset)
    # Four runs of the 4 s interval, each sent by both beats (the second copy dropped).
    run_until(
        journal,
        lambda es: (
            count(es, "start", name=name) >= 4
            and len([e for e in es if e["event"] == "contended" and f'"name":"{name}"' in e["key"]])
            >= 3
        ),
        f"4 runs of {name}, 3 copies dropped",
    )
    a.stop()
    b.stop()
    starts = settle(journal, name)
    assert len(starts) >= 4, [s["t"] for s in starts]
    # Each period ran once: two runs of one period would start less than a period apart.
    assert min(spacing(starts)) > 4 - 1 - DISPATCH_JITTER, spacing(starts)
    # Both beats sent every run: each run's second send was dropped.
    dropped = journal.select("contended", policy="drop")
    assert len([e for e in dropped if f'"name":"{name}"' in e["key"]]) >= 3


def test_leader_elected_beats_send_from_one_and_fail_over(
    single_only: None, wa: Any, worker: Worker, journal: Journal, beats: Any
) -> None:
    one = beats("leader-1", "led:0", scheduler="dlock")
    two = beats("leader-2", "led:0", scheduler="celery_dlock.beat:LeaderScheduler")
    run_until(journal, lambda es: count(es, "start", name="led") >= 3, "3 ticks from the leader")
    before = journal.select("start", name="led")
    senders = {s["beat"] for s in before}
    assert len(before) >= 3
    assert len(senders) == 1, f"more than one beat sent: {senders}"
    assert journal.select("contended", policy="drop") == [], "a follower sent a tick"
    leader_pid = int(senders.pop().rsplit(":", 1)[1])
    leader, follower = (one, two) if one.pid == leader_pid else (two, one)
    assert leader.pid == leader_pid
    # The follower said once that it follows, and whom.
    follows = [line for line in follower.log().splitlines() if " follows; " in line]
    assert len(follows) == 1, follower.log()
    assert f":{leader_pid} holds 'beat-leader:" in follows[0]
    assert " is the leader " not in follower.log()
    follower_pid = follower.pid
    leader.kill()
    killed_at = time.monotonic()
    killed_wall = time.time()

    def from_follower(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            e
            for e in entries
            if e["event"] == "start"
            and e.get("name") == "led"
            and str(e.get("beat", "")).endswith(f":{follower_pid}")
        ]

    run_until(
        journal,
        lambda es: len(from_follower(es)) >= 2,
        "2 ticks from the follower after the leader died",
    )
    follower.stop()
    starts = settle(journal, "led")
    # Starts are dated by the worker, not by the send: a tick the leader sent just before it
    # was killed can start after ``killed_at``. Those come first; then only the follower's.
    after = [(s["t"], int(s["beat"].rsplit(":", 1)[1])) for s in starts if s["t"] > killed_at]
    senders = [pid for _, pid in after]
    assert follower_pid in senders, "no tick ran after the leader died"
    taken_over = senders.index(follower_pid)
    assert set(senders[:taken_over]) <= {leader_pid}, senders
    assert set(senders[taken_over:]) == {follower_pid}, senders
    # When the follower sent its first tick: its slot, the 1 s period of the wall clock its send
    # fell in (the worker's start adds the host's dispatch delay, which is not the failover's).
    first_send = min(slot_of(s) for s in from_follower(starts))
    resumed = first_send - killed_wall
    assert resumed < 3 + 1 + 1.0, f"ticks resumed {resumed:.2f} s after the leader died (ttl 3 s)"
    per_slot = Counter(slot_of(s) for s in starts)
    assert all(n == 1 for n in per_slot.values()), per_slot


def test_a_slow_job_never_overlaps_itself(
    single_only: None, wa: Any, worker: Worker, journal: Journal, beats: Any
) -> None:
    beat = beats("slow", "slow:2.5")
    run_until(
        journal,
        lambda es: count(es, "end", name="slow") >= 2 and count(es, "contended") >= 3,
        "2 runs of the slow job, 3 ticks dropped meanwhile",
    )
    beat.stop()
    settle(journal, "slow")
    spans = intervals(journal.entries(), name="slow")
    assert len(spans) >= 2
    assert overlaps(spans) == []
    # Ticks that came while it ran were dropped, naming the run that held the key.
    assert len(journal.select("contended", policy="drop")) >= 3


def test_the_scheduler_alias(tmp_path: Any) -> None:
    from celery import Celery
    from celery.beat import Service

    from celery_dlock.celery.beat import LeaderScheduler

    app = Celery("alias", set_as_current=False)
    service = Service(app, scheduler_cls="dlock", schedule_filename=str(tmp_path / "s"))
    assert isinstance(service.get_scheduler(lazy=True), LeaderScheduler)
