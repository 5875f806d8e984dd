"""`pushkv bench core`: the coordinator's own CPU per rendezvous, in-process."""

from __future__ import annotations

import io
import re

import pytest

from bench import coordinator_core as core


def test_every_rank_is_ordered_and_every_rendezvous_completes_at_tp_4() -> None:
    """At TP 4 each prefill rank's session gets an order per transfer (checked
    in the run), the write reports and arrivals go on each rank's own session,
    and every transfer ends COMPLETE (the run raises otherwise)."""
    results = core.run(n=48, batch=16, reps=2, with_metrics=False, tp=4)
    assert len(results) == 2
    for r in results:
        assert all(r[p] > 0 for p in core.CORE_PHASES), r
    out = io.StringIO()
    median = core.report(results, out)
    assert median > 0
    assert "core_us_per_rendezvous=" in out.getvalue()


def test_tp_below_one_is_refused() -> None:
    assert core.main(["--tp", "0"]) == 2


def test_partitions_run_side_by_side_with_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    """--partitions 2: each repetition runs one process, then two together
    (spawned, every transfer of each checked COMPLETE there: a child that
    raises fails the run), and prints both rates and their ratio."""
    assert core.main(["--partitions", "2", "--n", "64", "--batch", "16", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    reps = re.findall(r"rep \d: 1 process +(\d+)/s, 2 processes +(\d+)/s, ratio ([\d.]+)", out)
    assert len(reps) == 2, out
    assert all(float(one) > 0 and float(two) > 0 for one, two, _ in reps), out
    m = re.search(r"^partitions=2 rendezvous_per_s=(\d+) one_process_per_s=(\d+) ratio=", out, re.M)
    assert m is not None, out


def test_partitions_below_one_are_refused() -> None:
    assert core.main(["--partitions", "0"]) == 2
