"""The serving benchmark's critical-path breakdown (pushkv/bench/serving/critpath.py),
from synthetic client records, front timings and coordinator timelines: which
timestamp bounds which stage, and exact p50 / p99 (linear interpolation)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pushkv.bench.serving.config import BenchConfig
from pushkv.bench.serving.critpath import (
    PATH_ARMED,
    PATH_LEFT,
    PATH_POST,
    PATH_PUSHKV,
    PATH_VLLM,
    TTFT_STAGE,
    Event,
    breakdown,
    critical_path,
    paths_of,
    request_marks,
    stages_of,
)
from pushkv.bench.serving.report import report
from pushkv.bench.serving.results import RateResult, SystemRun, pushkv_stages
from pushkv.bench.serving.workload import ReqRecord
from pushkv.router.timings import DECODE_FIRST_BYTE, PREFILL_RESPONSE, FrontTimings

T0 = 1000.0  # small: unix-sized times would round at 0.24 us
MS = 1e-3
# write_posted -> write_done per request: p50 3, p99 4 + (100 - 4) * 0.96 = 96.16
WRITE_MS = (1.0, 2.0, 3.0, 4.0, 100.0)


def approx(x: float) -> object:
    return pytest.approx(x, abs=1e-6)


def rec(i: int, first_ms: float, ok: bool = True) -> ReqRecord:
    r = ReqRecord(i, 100, 0.0, sent_unix=T0 + i, response_id=f"cmpl-tx-{i}")
    if ok:
        r.first, r.first_unix = first_ms * MS, T0 + i + first_ms * MS
    else:
        r.error = "HTTP 500"
    return r


def pushkv_timeline(i: int, write_ms: float, ranks: int = 1) -> list[Event]:
    """A transfer begun at T0 + i: prefill finished at +10 ms, posted at +12 (the
    last rank +1 ms later), done `write_ms` after that, arrived 0.5 ms after done."""
    t = T0 + i
    ev: list[Event] = [
        ("begun", t, -1),
        ("decode_registered", t + 2 * MS, -1),
        ("prefill_finished", t + 10 * MS, -1),
        ("prefill_done", t + 11 * MS, -1),
        ("ordered", t + 11.5 * MS, -1),
    ]
    for r in range(ranks):
        posted = t + (12 + r) * MS
        ev.append(("write_posted", posted, r))
    last_posted = t + (12 + ranks - 1) * MS
    for r in range(ranks):
        ev.append(("write_done", last_posted + write_ms * MS - (ranks - 1 - r) * MS, r))
    done = last_posted + write_ms * MS
    ev += [("arrived", done + 0.5 * MS, r) for r in range(ranks)]
    ev.append(("complete", done + 0.6 * MS, -1))
    return ev


def test_paths_and_stage_names() -> None:
    # Its own (whole-request, and armed), and the front's view.
    assert paths_of("pushkv") == (PATH_PUSHKV, PATH_ARMED, PATH_POST, PATH_LEFT, PATH_VLLM)
    assert paths_of("pushkv-whole") == (PATH_PUSHKV, PATH_POST, PATH_LEFT, PATH_VLLM)
    assert stages_of(PATH_POST) == ["prefill_finished->decode_first_byte"]
    assert stages_of(PATH_LEFT) == ["prefill_finished->write_done"]
    assert paths_of("pull") == paths_of("vllm-push") == paths_of("pull-noprog") == (PATH_VLLM,)
    assert paths_of("single") == ()
    assert stages_of(PATH_VLLM) == [
        "sent->prefill_response",
        "prefill_response->decode_first_byte",
        "decode_first_byte->client_first_byte",
        TTFT_STAGE,
    ]
    assert stages_of(PATH_ARMED) == [
        "sent->write_posted",
        "write_posted->write_done",
        "write_done->kv_ready",
        "kv_ready->decode_first_byte",
        "decode_first_byte->client_first_byte",
        TTFT_STAGE,
    ]
    assert stages_of(PATH_PUSHKV) == [
        "sent->prefill_finished",
        "prefill_finished->prefill_done",
        "prefill_done->ordered",
        "ordered->write_posted",
        "write_posted->write_done",
        "write_done->kv_ready",
        "kv_ready->decode_first_byte",
        "decode_first_byte->client_first_byte",
        TTFT_STAGE,
    ]


def test_request_marks_take_the_last_rank_and_map_timeline_stages() -> None:
    r = rec(0, first_ms=30.0)
    front = {DECODE_FIRST_BYTE: T0 + 28 * MS, PREFILL_RESPONSE: T0 + 13 * MS}
    m = request_marks(r, front, pushkv_timeline(0, write_ms=5.0, ranks=2))
    # two ranks: posted at +12 and +13, done at +17 and +18, arrived +18.5 (both)
    assert m == pytest.approx(
        {
            "sent": T0,
            "client_first_byte": T0 + 30 * MS,
            "prefill_finished": T0 + 10 * MS,
            "prefill_done": T0 + 11 * MS,
            "ordered": T0 + 11.5 * MS,
            "write_posted": T0 + 13 * MS,
            "write_done": T0 + 18 * MS,
            "kv_ready": T0 + 18.5 * MS,
            "decode_first_byte": T0 + 28 * MS,
            "prefill_response": T0 + 13 * MS,
        },
        abs=1e-9,
    )
    assert request_marks(rec(1, 0.0, ok=False), front) == {}


def test_pushkv_breakdown_exact_p50_p99_per_stage() -> None:
    recs = [rec(i, first_ms=40.0 + w) for i, w in enumerate(WRITE_MS)]
    recs.append(rec(9, 0.0, ok=False))  # failed: left out
    timelines = {f"tx-{i}": pushkv_timeline(i, w) for i, w in enumerate(WRITE_MS)}
    # the router read the prefill's answer at +13 ms and the decode engine's
    # first bytes 1 ms before the client did
    front = {
        f"tx-{i}": {PREFILL_RESPONSE: T0 + i + 13 * MS, DECODE_FIRST_BYTE: T0 + i + (39 + w) * MS}
        for i, w in enumerate(WRITE_MS)
    }
    got = critical_path("pushkv", recs, front, timelines)
    assert list(got) == [
        *stages_of(PATH_PUSHKV),
        "prefill_finished->decode_first_byte",
        "prefill_finished->write_done",
        "sent->prefill_response",
        "prefill_response->decode_first_byte",
    ]
    # prefill finished at +10 ms, decode's first bytes at 39 + w
    assert got["prefill_finished->decode_first_byte"]["p50"] == approx(32.0)
    # ... and the last DONE at 12 + w: the copy left after it, 2 + w
    assert got["prefill_finished->write_done"] == {
        "p50": approx(5.0),
        "p99": approx(98.16),
        "n": 5.0,
    }
    constant = {
        "sent->prefill_finished": 10.0,
        "prefill_finished->prefill_done": 1.0,
        "prefill_done->ordered": 0.5,
        "ordered->write_posted": 0.5,
        "write_done->kv_ready": 0.5,
        "decode_first_byte->client_first_byte": 1.0,
        "sent->prefill_response": 13.0,
    }
    for stage, ms in constant.items():
        assert got[stage] == {"p50": approx(ms), "p99": approx(ms), "n": 5.0}, stage
    assert got["write_posted->write_done"] == {"p50": approx(3.0), "p99": approx(96.16), "n": 5.0}
    # kv_ready at 12.5 + w, decode's first bytes at 39 + w: always 26.5
    assert got["kv_ready->decode_first_byte"]["p50"] == approx(26.5)
    # the front's view: 27, 28, 29, 30, 126 ms from the prefill's answer
    assert got["prefill_response->decode_first_byte"] == {
        "p50": approx(29.0),
        "p99": approx(122.16),
        "n": 5.0,
    }
    # TTFT 41, 42, 43, 44, 140: p99 = 44 + 96 * 0.96
    assert got[TTFT_STAGE] == {"p50": approx(43.0), "p99": approx(136.16), "n": 5.0}


def armed_timeline(i: int, write_ms: float) -> list[Event]:
    """An armed transfer begun at T0 + i: armed at +2 ms, the prefill worker
    fired (POSTED heard) at +11, done `write_ms` later; prefill's report last."""
    t = T0 + i
    done = t + (11 + write_ms) * MS
    return [
        ("begun", t, -1),
        ("decode_registered", t + 2 * MS, -1),
        ("armed", t + 2 * MS, -1),
        ("write_posted", t + 11 * MS, 0),
        ("write_done", done, 0),
        ("arrived", done + 0.5 * MS, 0),
        ("complete", done + 0.6 * MS, -1),
    ]


def test_armed_requests_take_the_armed_path_and_the_others_the_ordered_one() -> None:
    recs = [rec(0, 30.0), rec(1, 35.0), rec(2, 50.0)]
    timelines = {
        "tx-0": armed_timeline(0, 2.0),
        "tx-1": armed_timeline(1, 4.0),
        "tx-2": pushkv_timeline(2, 9.0),
    }
    got = critical_path("pushkv", recs, {}, timelines)
    assert got["sent->write_posted"] == {"p50": approx(11.0), "p99": approx(11.0), "n": 2.0}
    # Shared from write_posted on: the armed requests' only.
    assert got["write_posted->write_done"]["n"] == 2.0
    assert got["write_posted->write_done"]["p50"] == approx(3.0)
    assert got["prefill_done->ordered"] == {"p50": approx(0.5), "p99": approx(0.5), "n": 1.0}
    assert got[TTFT_STAGE]["n"] == 3.0
    # The whole-request control has no armed path.
    assert "sent->write_posted" not in critical_path("pushkv-whole", recs, {}, timelines)


def test_a_request_without_a_transfer_counts_only_in_the_stages_it_has() -> None:
    recs = [rec(0, 50.0), rec(1, 60.0)]
    timelines = {"tx-0": pushkv_timeline(0, 4.0)}  # tx-1 served by decode alone
    got = critical_path("pushkv", recs, {}, timelines)
    assert got["write_posted->write_done"] == {"p50": approx(4.0), "p99": approx(4.0), "n": 1.0}
    assert "kv_ready->decode_first_byte" not in got  # no front timings at all
    assert got[TTFT_STAGE] == {"p50": approx(55.0), "p99": approx(59.9), "n": 2.0}


def test_vllm_connectors_get_the_front_observed_stages_only() -> None:
    recs = [rec(i, first_ms=100.0 + 10 * i) for i in range(3)]
    front = {
        f"tx-{i}": {
            PREFILL_RESPONSE: T0 + i + 20 * MS,
            DECODE_FIRST_BYTE: T0 + i + (99 + 10 * i) * MS,
        }
        for i in range(3)
    }
    got = critical_path("pull", recs, front, {})
    assert got == {
        "sent->prefill_response": {"p50": approx(20.0), "p99": approx(20.0), "n": 3.0},
        # 79, 89, 99: p99 = 89 + 10 * 0.98
        "prefill_response->decode_first_byte": {
            "p50": approx(89.0),
            "p99": approx(98.8),
            "n": 3.0,
        },
        "decode_first_byte->client_first_byte": {"p50": approx(1.0), "p99": approx(1.0), "n": 3.0},
        TTFT_STAGE: {"p50": approx(110.0), "p99": approx(119.8), "n": 3.0},
    }
    assert critical_path("single", recs, front, {}) == {}


def test_breakdown_of_nothing_is_empty() -> None:
    assert breakdown([], PATH_PUSHKV) == {}
    assert breakdown([{"sent": 1.0}], PATH_VLLM) == {}


def test_transfer_stages_report_p50_and_p99() -> None:
    recs = [rec(i, first_ms=40.0 + w) for i, w in enumerate(WRITE_MS)]
    timelines = {f"tx-{i}": pushkv_timeline(i, w) for i, w in enumerate(WRITE_MS)}
    got = pushkv_stages(timelines, recs)
    # ordered at +11.5, the write done at +12 + w
    assert got["ordered->write_done"] == {"p50": approx(3.5), "p99": approx(96.66), "n": 5.0}
    assert got["send->decode_registered"]["p99"] == approx(2.0)


def test_report_prints_p50_and_p99_and_dashes_for_unobserved_stages() -> None:
    q = {"p50": 1.0, "p90": 1.0, "p99": 1.0}
    res = RateResult(1.0, 5, 5, 0, 0, 1.0, 1.0, 1.0, q, q, 1.0, True)
    res.critpath_ms = {"sent->prefill_finished": {"p50": 10.0, "p99": 12.4, "n": 5.0}}
    run = SystemRun("pushkv", "nocache", rates=[res])
    cfg = BenchConfig(model_dir=Path("/nonexistent"), rates=(1.0,), systems=("pushkv",))
    lines = report(cfg, {"nocache": {"pushkv": run}})
    head = next(i for i, ln in enumerate(lines) if "critical path" in ln)
    assert lines[head + 1].startswith("| rate | sent->prefill_finished | prefill_finished->")
    assert lines[head + 3].startswith("| 1 | 10.0 / 12.4 | - | - |")
    view = next(i for i, ln in enumerate(lines) if "the stages the front sees" in ln)
    assert lines[view + 3] == "| 1 | - | - | - | - |"  # none observed


def test_front_timings_keep_the_first_mark_and_forget_the_oldest() -> None:
    ft = FrontTimings(limit=2)
    ft.mark("a", DECODE_FIRST_BYTE, at=1.0)
    ft.mark("a", DECODE_FIRST_BYTE, at=2.0)  # a later chunk: not the first byte
    ft.mark("a", PREFILL_RESPONSE, at=0.5)
    ft.mark("", DECODE_FIRST_BYTE, at=3.0)  # no id: nothing to key it by
    assert ft.snapshot() == {"a": {DECODE_FIRST_BYTE: 1.0, PREFILL_RESPONSE: 0.5}}
    ft.mark("b", DECODE_FIRST_BYTE, at=4.0)
    ft.mark("c", DECODE_FIRST_BYTE, at=5.0)
    assert list(ft.snapshot()) == ["b", "c"]
