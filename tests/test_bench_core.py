"""`pushkv bench core`: the coordinator's own CPU per rendezvous, in-process."""

from __future__ import annotations

import io

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
