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
    assert core.main(["--seam", "0"]) == 2


def test_the_seam_runs_k_partitions_in_process_beside_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--seam 3: each repetition runs one state machine, then three
    partitions in the same process (every transfer checked COMPLETE in each:
    the run raises otherwise), and prints both tables and the cost ratio."""
    assert core.main(["--seam", "3", "--tp", "2", "--n", "64", "--batch", "16", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert "-- one state machine" in out and "-- 3 partitions" in out, out
    m = re.search(r"^seam_partitions=3 cost_ratio_median=([\d.]+) ", out, re.M)
    assert m is not None and float(m.group(1)) > 0, out


def test_front_hop_answers_every_report_with_its_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--front-hop: a partition process answers each of the front's reports
    with an order over a Unix socket (the run raises if one is missing or the
    partition fails), and the line gives both sides' CPU and the baseline."""
    assert core.main(["--front-hop", "--n", "300", "--batch", "7", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"rep \d: front +[\d.]+ us, partition +[\d.]+ us", out)) == 2, out
    m = re.search(
        r"^front_hop: batch=7 front_us=([\d.]+) partition_us=([\d.]+) in_process_us=([\d.]+) "
        r"added_us=-?[\d.]+ round_trips_per_s=(\d+)$",
        out,
        re.M,
    )
    assert m is not None, out
    assert all(float(x) > 0 for x in m.groups()), out


def test_procs_runs_partition_processes_beside_one_in_process(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--procs 2: each repetition one in-process Runtime, then one and two
    partition processes (every transfer checked COMPLETE and ordered by its
    own partition: the run raises otherwise), and a line per K."""
    argv = ["--procs", "2", "--tp", "2", "--n", "48", "--batch", "16", "--reps", "1"]
    assert core.main(argv) == 0
    out = capsys.readouterr().out
    for k in (1, 2):
        m = re.search(
            rf"^procs: k={k} tp=2 rendezvous_per_s=(\d+) partitions_us=([\d.]+) "
            r"front_us=([\d.]+) in_process_us=([\d.]+) partitions_over_in_process=[\d.]+$",
            out,
            re.M,
        )
        assert m is not None, out
        assert int(m.group(1)) > 0 and float(m.group(4)) > 0, out
    assert core.main(["--procs", "-1"]) == 2


def test_frames_are_cut_whole_and_the_rest_kept() -> None:
    from pushkv.net.frames import HEADER, take_frames

    data = bytearray(HEADER.pack(3) + b"abc" + HEADER.pack(0) + HEADER.pack(5) + b"de")
    assert take_frames(data) == [b"abc", b""]
    assert data == bytearray(HEADER.pack(5) + b"de")  # a frame not yet whole stays
    data += b"fgh"
    assert take_frames(data) == [b"defgh"] and data == bytearray()


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
