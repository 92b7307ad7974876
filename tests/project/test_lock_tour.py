"""The tour of lock() (python -m example_project.lock_tour) keeps working and tells the truth."""

from __future__ import annotations

import pytest

from example_project.lock_tour import main


@pytest.mark.local_redis
@pytest.mark.parametrize("argv", [[], ["--redlock"]], ids=["single", "redlock5"])
def test_lock_tour_runs_and_exits_zero(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "task-B refused at once" in out
    assert "took over" in out
    assert "LockLost" in out
    assert out.rstrip().endswith("demo OK")
