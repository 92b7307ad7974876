"""Same-run comparison of two commits: is this tree slower than ``--base`` on a benchmark?

A refactoring must not make the lock path slower, and two separate benchmark runs on a small VM
differ by more than such a change could. This exports ``--base`` (any git ref) into a temporary
directory and runs the benchmark alternately from that tree and from this one (``--runs`` times
each, order flipped every run), each as its own process with its own ``PYTHONPATH`` and its own
copy of the benchmark script, then prints per row the median over runs of each tree and the ratio
this/base — raw, and normalised by the benchmark's own baseline row in the same process (``raw``
for ``lock_cycle.py``, ``plain`` for ``task_path.py``), which cancels the drift of the machine
between two processes.

Run: ``python benchmarks/compare.py --base 205c568 [--runs 3] -- task_path.py --tasks 2000``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent

#: Per benchmark: the figures compared per row, and the row other rows are divided by.
READERS: dict[str, tuple[tuple[str, ...], str]] = {
    "lock_cycle.py": (("median_us", "client_cpu_us"), "raw"),
    "task_path.py": (("cpu_us", "wall_us"), "plain"),
}


def export(ref: str, into: Path) -> Path:
    """The tree of ``ref`` as files under ``into`` (``git archive``; no checkout is touched)."""
    archive = subprocess.run(
        ["git", "-C", str(HERE), "archive", "--format=tar", ref],
        check=True,
        capture_output=True,
    ).stdout
    into.mkdir(parents=True)
    tar_path = into.with_suffix(".tar")
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    return into


def rows_of(script: str, result: dict[str, Any]) -> dict[str, dict[str, float]]:
    if script == "lock_cycle.py":
        return dict(result["variants"])
    return dict(result["figures"])


def run_once(tree: Path, script: str, args: list[str]) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, str(tree / "benchmarks" / script), *args, "--json"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tree,
        env=env,
    ).stdout
    return rows_of(script, json.loads(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git ref to compare against")
    parser.add_argument("--runs", type=int, default=3, help="runs per tree, interleaved")
    parser.add_argument("script", choices=sorted(READERS), help="benchmark in benchmarks/")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    opts = parser.parse_args()
    figures, baseline = READERS[opts.script]
    extra = [a for a in opts.args if a != "--"]
    head = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    results: dict[str, list[dict[str, dict[str, float]]]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"base": export(opts.base, Path(tmp) / "base"), "this": HERE}
        for i in range(opts.runs):
            for name in ("base", "this") if i % 2 == 0 else ("this", "base"):
                print(f"run {i + 1}/{opts.runs}: {name}", file=sys.stderr, flush=True)
                results[name].append(run_once(trees[name], opts.script, extra))
    print(
        f"{opts.script} {' '.join(extra)}: base {opts.base}, this {head} (uncommitted changes "
        f"included), {opts.runs} runs each, interleaved; medians over runs"
    )
    print(
        f"{'row':<12} {'figure':<14} {'base':>9} {'this':>9} {'this/base':>10} "
        f"{'(/' + baseline + ')':>10}"
    )
    for row in results["this"][0]:
        if row not in results["base"][0]:
            continue
        for fig in figures:
            b = statistics.median(r[row][fig] for r in results["base"])
            t = statistics.median(r[row][fig] for r in results["this"])
            bn = statistics.median(r[row][fig] / r[baseline][fig] for r in results["base"])
            tn = statistics.median(r[row][fig] / r[baseline][fig] for r in results["this"])
            print(f"{row:<12} {fig:<14} {b:>9.1f} {t:>9.1f} {t / b:>10.3f} {tn / bn:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
