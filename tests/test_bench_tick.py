"""`python -m pushkv.bench.tick_wakeups`: the coordinator's clock under load."""

from __future__ import annotations

import pytest

from pushkv.bench import tick_wakeups
from pushkv.controlplane.runtime import TICK_MAX_S


def test_under_load_the_clock_wakes_at_its_idle_pace(capsys: pytest.CaptureFixture[str]) -> None:
    """100 TP-8 rendezvous/s with 1,000 agents, past the write timeout: the
    deadlines the ended transfers left behind (one every 10 ms) no longer wake
    the tick; it runs at its 0.25 s pace, 4 times a simulated second (it woke
    100 times a second before, scanning every agent's lease each time)."""
    assert (
        tick_wakeups.main(["--rate", "100", "--seconds", "2", "--warmup", "16", "--reps", "1"]) == 0
    )
    out = capsys.readouterr().out
    ticks = next(ln for ln in out.splitlines() if ln.startswith("ticks_per_s:"))
    assert float(ticks.split()[1]) <= 1 / TICK_MAX_S, out
