"""`pushkv bench core`: the coordinator's own CPU per rendezvous, in-process."""

from __future__ import annotations

import io
import re

import pytest

from pushkv.bench import coordinator_core as core


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


def test_retained_transfers_are_counted_and_a_full_pass_timed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--retained N: N rendezvous stay as terminal transfers (the run raises
    if fewer are retained), and the line gives the objects each holds, the
    RSS and the full GC passes over them; the process's GC policy is left as
    it was."""
    from pushkv.controlplane import gcpolicy

    before = gcpolicy.installed()  # other runs here install it (`pushkv bench core` does)
    assert core.main(["--retained", "64", "--tp", "2", "--batch", "16"]) == 0
    assert gcpolicy.installed() == before
    out = capsys.readouterr().out
    m = re.search(
        r"^retained=64 objects_per_transfer=([\d.]+) rss_mib=(\d+) full_pass_ms=(\d+)$", out, re.M
    )
    assert m is not None, out
    per, rss = float(m.group(1)), int(m.group(2))
    # Two per rank (its record and its order) and about 8 for the transfer
    # (12.2 at TP 2; 14.3 while its engine sets were sets, not tuples).
    assert 5 < per < 2 * 2 + 9 and rss > 0, out
    assert re.search(r"a full GC pass \d+ ms median \(\d+, \d+, \d+\)", out), out
