"""``python -m tests.support.faults [--profile short|long] [--mode single|redlock5|both]``

Runs the fault-injection workload and prints the checker's figures as JSON; exits 1 if any
check failed. The long profile is what docs/reliability.md reports.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tests.support.faults.harness import LONG, SHORT, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.faults")
    parser.add_argument("--profile", choices=("short", "long"), default="long")
    parser.add_argument("--mode", choices=("single", "redlock5", "both"), default="both")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    profile = LONG if args.profile == "long" else SHORT
    modes = ("single", "redlock5") if args.mode == "both" else (args.mode,)
    ok = True
    for mode in modes:
        directory = Path(tempfile.mkdtemp(prefix=f"dlock-faults-{mode}-"))
        report = run(mode, profile, directory, seed=args.seed)
        summary = {"mode": mode, "profile": profile.name, "history": str(directory),
                   **report.summary()}  # fmt: skip
        print(json.dumps(summary, indent=2), flush=True)
        ok &= report.ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
