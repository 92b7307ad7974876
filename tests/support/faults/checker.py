"""Check a fault run's history, as a program and not by eye (Jepsen-style).

Reads the entries the executions wrote (:mod:`tests.support.faults.history`), the fault events the
harness wrote, and the store's log of write attempts, and verifies:

* **no overlap**: no two executions of one key held valid leases at the same time. An
  execution's valid span runs from its start to the earliest of its end, and the latest
  validity it had evidence of (``valid_until`` recorded at start, at each check, before its
  write) — so a process frozen by SIGSTOP is not counted as holding past its lease;
* **tokens rise**: per key, fencing tokens strictly increase in acquisition (start) order;
* **fenced store**: no write was applied with a token older than one already applied to its
  key, and writes attempted after the writer's lease had run out are counted (each must have
  been refused when a newer token had been applied);
* **loss detected in time**: every lost lease was reported within the renewal interval plus a
  margin of a fault that could have caused it (or of its own validity running out);
* **exactly once**: every submitted job's effect was applied exactly once (nothing lost,
  nothing doubled); re-executions the store's per-job check absorbed are counted. A job whose
  last message vanished after a worker was SIGKILLed is counted apart, as lost in the broker:
  Kombu's Redis transport pops a message before it records it as unacked, so a worker killed
  in that window takes the message with it, before any code of this library runs.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.faults import history


@dataclass
class Execution:
    pid: int
    key: str
    token: int
    job: str
    start: float
    end: float | None = None
    outcome: str | None = None
    valid_until: float = 0.0
    lost_at: float | None = None

    @property
    def valid_end(self) -> float:
        ends = [self.valid_until]
        if self.end is not None:
            ends.append(self.end)
        if self.lost_at is not None:
            ends.append(self.lost_at)
        return min(ends)


@dataclass
class Report:
    executions: int = 0
    jobs: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    overlaps: list[str] = field(default_factory=list)
    token_order: list[str] = field(default_factory=list)
    stale_applied: list[str] = field(default_factory=list)
    late_writes: int = 0
    late_writes_refused: int = 0
    late_writes_applied_alone: int = 0  # late, but no newer token had been applied: harmless
    late_writes_absorbed: int = 0  # late, but its job was applied already: not applied again
    losses: int = 0
    detection_seconds: list[float] = field(default_factory=list)
    slow_detections: list[str] = field(default_factory=list)
    lost_jobs: list[str] = field(default_factory=list)  # lost, and not the broker's doing
    lost_in_broker: list[str] = field(default_factory=list)
    doubled_jobs: list[str] = field(default_factory=list)
    absorbed_reruns: int = 0

    @property
    def ok(self) -> bool:
        return not (
            self.overlaps
            or self.token_order
            or self.stale_applied
            or self.slow_detections
            or self.lost_jobs
            or self.doubled_jobs
        )

    def summary(self) -> dict[str, Any]:
        detect = sorted(self.detection_seconds)
        return {
            "ok": self.ok,
            "jobs": self.jobs,
            "executions": self.executions,
            "faults": self.faults,
            "overlaps": len(self.overlaps),
            "token_order_violations": len(self.token_order),
            "stale_writes_applied": len(self.stale_applied),
            "late_writes": self.late_writes,
            "late_writes_refused": self.late_writes_refused,
            "late_writes_applied_alone": self.late_writes_applied_alone,
            "late_writes_absorbed": self.late_writes_absorbed,
            "leases_lost": self.losses,
            "detection_max_s": round(detect[-1], 3) if detect else None,
            "detection_median_s": round(detect[len(detect) // 2], 3) if detect else None,
            "slow_detections": len(self.slow_detections),
            "jobs_lost": len(self.lost_jobs),
            "jobs_lost_in_broker": len(self.lost_in_broker),
            "jobs_doubled": len(self.doubled_jobs),
            "reruns_absorbed": self.absorbed_reruns,
            "examples": (self.overlaps + self.token_order + self.stale_applied
                         + self.slow_detections + self.lost_jobs + self.doubled_jobs)[:10],
        }  # fmt: skip


def executions(entries: list[dict[str, Any]]) -> list[Execution]:
    runs: dict[tuple[int, str, int], Execution] = {}
    lost: dict[tuple[str, int], float] = {}
    for e in entries:
        if e["event"] == "lost" and e.get("token") is not None:
            lost.setdefault((e["key"], int(e["token"])), e["t"])
    for e in entries:
        if e["event"] not in ("start", "alive", "wrote", "end"):
            continue
        ident = (e["pid"], e["key"], int(e["token"]))  # tokens are per key
        run = runs.get(ident)
        if run is None:
            if e["event"] != "start":
                continue
            run = runs[ident] = Execution(e["pid"], e["key"], int(e["token"]), e["job"], e["t"])
        if "valid_until" in e:
            run.valid_until = max(run.valid_until, float(e["valid_until"]))
        if e["event"] == "end":
            run.end, run.outcome = e["t"], e["outcome"]
    for run in runs.values():
        run.lost_at = lost.get((run.key, run.token))
    return sorted(runs.values(), key=lambda r: r.start)


def check(
    entries: list[dict[str, Any]],
    writes: list[dict[str, Any]],
    jobs: list[str],
    *,
    interval: float,
    margin: float,
) -> Report:
    report = Report(jobs=len(jobs))
    runs = executions(entries)
    report.executions = len(runs)
    faults = [e for e in entries if e["event"] == "fault"]
    for f in faults:
        report.faults[f["kind"]] = report.faults.get(f["kind"], 0) + 1
    _check_keys(report, runs)
    _check_writes(report, runs, writes)
    _check_detection(report, runs, entries, faults, interval + margin)
    _check_jobs(report, entries, writes, jobs, faults)
    return report


def _check_keys(report: Report, runs: list[Execution]) -> None:
    by_key: dict[str, list[Execution]] = defaultdict(list)
    for run in runs:
        by_key[run.key].append(run)
    for key, key_runs in by_key.items():
        for i, a in enumerate(key_runs):
            for b in key_runs[i + 1 :]:
                if a.start < b.valid_end and b.start < a.valid_end:
                    report.overlaps.append(
                        f"{key}: token {a.token} [{a.start:.3f}, {a.valid_end:.3f}] and token "
                        f"{b.token} [{b.start:.3f}, {b.valid_end:.3f}]"
                    )
        for a, b in itertools.pairwise(key_runs):
            if b.token <= a.token:
                report.token_order.append(
                    f"{key}: token {b.token} (start {b.start:.3f}) after {a.token} "
                    f"(start {a.start:.3f})"
                )


def _check_writes(report: Report, runs: list[Execution], writes: list[dict[str, Any]]) -> None:
    latest: dict[str, int] = {}
    run_of = {(r.pid, r.key, r.token): r for r in runs}
    for w in writes:
        token = int(w["token"])
        if w["outcome"] == "applied":
            if token < latest.get(w["key"], 0):
                report.stale_applied.append(f"{w['key']}: token {token} applied after newer")
            latest[w["key"]] = max(latest.get(w["key"], 0), token)
        run = run_of.get((int(w["pid"]), w["key"], token))
        if run is not None and float(w["t"]) > run.valid_until:
            report.late_writes += 1
            if w["outcome"] == "stale":
                report.late_writes_refused += 1
            elif w["outcome"] == "applied":
                report.late_writes_applied_alone += 1
            else:  # "again": a redelivered copy applied the job first; nothing written
                report.late_writes_absorbed += 1


def _check_detection(
    report: Report,
    runs: list[Execution],
    entries: list[dict[str, Any]],
    faults: list[dict[str, Any]],
    bound: float,
) -> None:
    causes = sorted((f["t"], f["kind"]) for f in faults)
    for e in entries:
        if e["event"] != "lost":
            continue
        report.losses += 1
        run = next((r for r in runs if r.key == e["key"] and r.token == e.get("token")), None)
        before = [c for c in causes if c[0] <= e["t"]]
        candidates = [e["t"] - t for t, _ in before[-3:]]
        if run is not None and run.valid_until and run.valid_until <= e["t"]:
            candidates.append(e["t"] - run.valid_until)
        delay = min(candidates) if candidates else None
        if delay is None or delay > bound:
            # What a reader needs to tell a slow watchdog from a cause the checker missed.
            nearest = f"nearest fault {before[-1][1]} at {before[-1][0]:.3f}" if before else ""
            evidence = (
                "no execution started with this token"
                if run is None
                else f"execution {run.start:.3f}-{run.end}, valid until {run.valid_until:.3f}"
            )
            report.slow_detections.append(
                f"{e['key']} token {e.get('token')}: lost at {e['t']:.3f}, "
                f"{'no fault before it' if delay is None else f'{delay:.3f} s after its cause'}"
                f" ({e.get('reason')}; {nearest}; {evidence})"
            )
        else:
            report.detection_seconds.append(delay)


#: A message a killed worker had taken can have been delivered this long before the kill.
KILL_WINDOW = 10.0


def _check_jobs(
    report: Report,
    entries: list[dict[str, Any]],
    writes: list[dict[str, Any]],
    jobs: list[str],
    faults: list[dict[str, Any]],
) -> None:
    applied: dict[str, int] = defaultdict(int)
    for w in writes:
        if w["outcome"] == "applied":
            applied[w["job"]] += 1
        elif w["outcome"] == "again":
            report.absorbed_reruns += 1
    kills = [f["t"] for f in faults if f["kind"] == "kill-worker"]
    last_seen: dict[str, dict[str, Any]] = {}
    for e in entries:
        if e["event"] in ("published", "prerun") and e.get("job"):
            last_seen[e["job"]] = e
    for j in jobs:
        if applied.get(j, 0):
            continue
        # Last published, or delivered to a worker, and SIGKILLed soon after: Kombu's Redis
        # transport pops a message (BRPOP) before it records it as unacked, so a worker killed
        # in between takes the message with it. Anything else is this library's doing.
        last = last_seen.get(j)
        killed = last is not None and any(0 <= t - last["t"] <= KILL_WINDOW for t in kills)
        (report.lost_in_broker if killed else report.lost_jobs).append(j)
    report.doubled_jobs = [j for j in jobs if applied.get(j, 0) > 1]


def check_directory(directory: Path, *, interval: float, margin: float) -> Report:
    entries = history.read(directory)
    writes = [json.loads(line) for line in (directory / "writes.jsonl").read_text().splitlines()]
    jobs = json.loads((directory / "jobs.json").read_text())
    return check(entries, writes, jobs, interval=interval, margin=margin)


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    ttl = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    result = check_directory(folder, interval=ttl / 3, margin=1.0)
    print(json.dumps(result.summary(), indent=2))
    sys.exit(0 if result.ok else 1)
