"""The serving benchmark's summary: which rate the ratios are taken at, and what
they are, from synthetic per-rate results (the benchmark itself runs real
servers for minutes and is not part of the suite)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pushkv.bench.serving import first_token
from pushkv.bench.serving.config import BenchConfig
from pushkv.bench.serving.main import _parse, plot_path
from pushkv.bench.serving.processes import worker_schedstat
from pushkv.bench.serving.report import final_line, report, single_floor
from pushkv.bench.serving.results import RateResult, SystemRun, summarize
from pushkv.bench.serving.vllm_patches import sitecustomize
from pushkv.bench.serving.workload import ReqRecord, event_tokens

RATES = (0.5, 1.0, 2.0)


def _rate(rate: float, ttft: float, tpot: float, sustained: bool = True) -> RateResult:
    q = {"p50": ttft, "p90": ttft * 2, "p99": ttft * 3}
    t = {"p50": tpot, "p90": tpot * 2, "p99": tpot * 3}
    return RateResult(rate, 10, 10, 0, 0, rate, rate, rate, q, t, ttft + 100, sustained)


def _run(system: str, rows: list[tuple[float, float, bool]], tpot: float = 10.0) -> SystemRun:
    run = SystemRun(system, "nocache")
    run.rates = [_rate(r, ttft, tpot, ok) for r, ttft, ok in rows]
    return run


def _cfg(systems: tuple[str, ...]) -> BenchConfig:
    return BenchConfig(model_dir=Path("/nonexistent"), rates=RATES, systems=systems)


def _runs(vllm_push_sustains_2: bool) -> dict[str, SystemRun]:
    return {
        "pull": _run("pull", [(0.5, 400, True), (1.0, 600, True), (2.0, 900, True)], tpot=10),
        "vllm-push": _run(
            "vllm-push",
            [(0.5, 800, True), (1.0, 1000, True), (2.0, 5000, vllm_push_sustains_2)],
        ),
        "pushkv": _run("pushkv", [(0.5, 200, True), (1.0, 300, True), (2.0, 300, True)], tpot=5),
        "single": _run("single", [(0.5, 150, True), (1.0, 180, True), (2.0, 240, True)]),
    }


def test_ratios_are_taken_at_the_highest_rate_every_compared_system_sustained() -> None:
    runs = _runs(vllm_push_sustains_2=False)
    line, rate = final_line(_cfg(tuple(runs)), runs)
    assert rate == 1.0
    assert line == (
        "ttft_p50_ratio_vs_pull=0.500 ttft_p50_ratio_vs_vllm_push=0.300 "
        "tpot_p50_ratio_vs_pull=0.500"
    )
    runs = _runs(vllm_push_sustains_2=True)
    assert final_line(_cfg(tuple(runs)), runs)[1] == 2.0


def test_a_failed_system_gives_nan_and_does_not_bind_the_rate() -> None:
    runs = _runs(vllm_push_sustains_2=False)
    runs["vllm-push"] = SystemRun("vllm-push", "nocache", error="did not start")
    line, rate = final_line(_cfg(tuple(runs)), runs)
    assert rate == 2.0  # only pull and pushkv bind it now
    assert "ttft_p50_ratio_vs_vllm_push=nan" in line
    assert "ttft_p50_ratio_vs_pull=0.333" in line


def test_the_single_engine_reference_is_reported_at_the_same_rate() -> None:
    runs = _runs(vllm_push_sustains_2=False)
    cfg = _cfg(tuple(runs))
    ref = single_floor(cfg, runs)
    assert ref == (
        "reference at 1 req/s: single-engine TTFT p50 / pull = 0.30 (no transfer, no second engine)"
    )
    assert ref in report(cfg, {"nocache": runs})
    del runs["single"]
    assert single_floor(cfg, runs) is None


def test_with_no_rate_sustained_by_all_the_lowest_rate_is_used() -> None:
    runs = _runs(vllm_push_sustains_2=False)
    runs["pull"] = _run("pull", [(0.5, 400, False), (1.0, 600, False), (2.0, 900, False)])
    line, rate = final_line(_cfg(tuple(runs)), runs)
    assert rate == 0.5
    assert not math.isnan(float(line.split()[0].split("=")[1]))


def test_worker_schedstat_reads_only_vllm_worker_main_threads() -> None:
    # A real process named as vLLM names its workers, which has run for a while.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "open('/proc/self/comm', 'w').write('VLLM::Worker')\n"
            "x = 0\n"
            "for i in range(2_000_000): x += i\n"
            "print('ran', flush=True)\n"
            "input()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ran\n"
        run, wait = worker_schedstat([child.pid])
        assert run > 10_000_000  # it ran well over 10 ms
        assert wait >= 0
        assert worker_schedstat([os.getpid()]) == (0, 0)  # not a vLLM worker
        assert worker_schedstat([2**22 + 7]) == (0, 0)  # no such process
    finally:
        child.kill()
        child.wait(10)


def test_the_spin_shim_bounds_vllms_shm_queue_busy_poll(tmp_path: Path) -> None:
    # Loaded as sitecustomize (as the benchmark loads it, with the unpinning shim
    # and the progress-thread patch), in a real interpreter that imports vLLM's
    # message queue.
    (tmp_path / "sitecustomize.py").write_text(sitecustomize(unpin=True, noprog=True, spin_ms=2))
    probe = (
        "import zmq\n"
        "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition\n"
        f"c = SpinCondition(True, zmq.Context(), 'ipc://{tmp_path}/notify')\n"
        "print(c.busy_loop_s)\n"
    )

    def busy_loop_s(shim: bool) -> str:
        env = {**os.environ, "PYTHONPATH": str(tmp_path) if shim else ""}
        out = subprocess.run(
            [sys.executable, "-c", probe],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip().splitlines()[-1]

    assert busy_loop_s(shim=True) == "0.002"
    assert busy_loop_s(shim=False) == "1"  # vLLM's own, when not asked


def test_spin_below_the_minimum_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--vllm-spin-ms", "0"])
    assert "--vllm-spin-ms must be at least 1" in capsys.readouterr().err
    cfg, _ = _parse(["--vllm-spin-ms", "2", "--quick"])
    assert cfg.vllm_spin_ms == 2.0
    assert _parse(["--quick"])[0].vllm_spin_ms is None


def test_a_baseline_tpot_seen_as_zero_gives_no_ratio() -> None:
    # A starved API server that sends a response in one chunk shows TPOT 0.0 ms:
    # no ratio is taken against it, in the table or the final line.
    runs = _runs(vllm_push_sustains_2=False)
    runs["pull"] = _run("pull", [(0.5, 400, True), (1.0, 600, True), (2.0, 900, True)], tpot=0.007)
    cfg = _cfg(tuple(runs))
    line, _ = final_line(cfg, runs)
    assert line.endswith("tpot_p50_ratio_vs_pull=nan")
    assert "ttft_p50_ratio_vs_pull=0.500" in line
    lines = report(cfg, {"nocache": runs})
    assert "| 1 | pull | 0.50 | 0.50 | 0.50 | n/a | n/a | n/a |" in lines
    assert any(x.startswith("n/a: the baseline's TPOT rounds to 0.0 ms") for x in lines)
    assert "| 1 | vllm-push | 0.30 | 0.30 | 0.30 | 0.50 | 0.50 | 0.50 |" in lines


def test_the_ucx_shim_gives_vllms_nixl_agents_pushkvs_ucx_params(tmp_path: Path) -> None:
    # vLLM's NIXL connectors build their agent as the first probe does (UCX from
    # nixl_agent_config, num_threads, no UCX params). Under the benchmark's shim
    # its UCX backend gets pushkv's agent's params; a creator that passes its own,
    # as pushkv's agent does, keeps them.
    from pushkv.agent.nixl_adapter import DEFAULT_UCX_PARAMS

    shim = sitecustomize(unpin=True, ucx_params=DEFAULT_UCX_PARAMS)
    (tmp_path / "sitecustomize.py").write_text(shim)
    probe = (
        "from nixl._api import nixl_agent, nixl_agent_config\n"
        "a = nixl_agent('vllm-like', nixl_agent_config(num_threads=4, capture_telemetry=True))\n"
        "print(sorted(a.backend_options['UCX'].items()))\n"
        "b = nixl_agent('own', nixl_agent_config(enable_prog_thread=False, backends=[]))\n"
        "b.create_backend('UCX', {'ucx_error_handling_mode': 'peer'})\n"
        "print(sorted(b.backend_options['UCX'].items()))\n"
    )

    def options(shimmed: bool) -> list[str]:
        env = {
            **os.environ,
            "PYTHONPATH": str(tmp_path) if shimmed else "",
            "NIXL_LOG_LEVEL": "WARN",
        }
        out = subprocess.run(
            [sys.executable, "-c", probe],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return [line for line in out.stdout.splitlines() if line.startswith("[(")]

    assert options(shimmed=True) == [
        "[('num_threads', '4'), ('ucx_error_handling_mode', 'none')]",
        "[('ucx_error_handling_mode', 'peer')]",
    ]
    assert options(shimmed=False)[0] == "[('num_threads', '4')]"  # NIXL's default: peer


def test_fault_summary_splits_requests_at_the_kill() -> None:
    from pushkv.bench.serving.fault import fault_lines, fault_summary

    recs = [
        ReqRecord(0, 100, sent=0.0, first=0.2, last=1.0, tokens=8),  # pushed
        ReqRecord(1, 100, sent=4.0, first=4.3, last=5.0, tokens=8),  # pushed
        ReqRecord(2, 100, sent=4.9, first=5.9, last=6.5, tokens=8),  # in flight at the kill
        ReqRecord(3, 100, sent=6.0, first=7.0, last=8.0, tokens=8),  # sent after it
        ReqRecord(4, 100, sent=7.0, error="HTTP 502"),  # failed
    ]
    f = fault_summary(recs, killed_at=5.0, fallbacks={"prefill_failed": 2.0})
    assert (f["requests"], f["ok"], f["success_rate"]) == (5, 4, 0.8)
    assert f["ttft_pushed_ms"]["n"] == 2 and f["ttft_after_kill_ms"]["n"] == 2
    assert f["ttft_pushed_ms"]["p50"] == pytest.approx(250.0)
    assert f["ttft_after_kill_ms"]["p50"] == pytest.approx(1000.0)
    assert f["errors"] == ["HTTP 502"]
    lines = fault_lines(f)
    assert "4/5 ok (success rate 0.800)" in lines[1]
    assert "after/pushed p50 ratio 4.00" in lines[2]


def test_kill_prefill_at_needs_pushkv_and_one_rate() -> None:
    with pytest.raises(SystemExit):
        _parse(["--kill-prefill-at", "5", "--rates", "1,2", "--systems", "pushkv"])
    with pytest.raises(SystemExit):
        _parse(["--kill-prefill-at", "5", "--rates", "1", "--systems", "pull"])
    cfg, _ = _parse(
        ["--kill-prefill-at", "5", "--rates", "1", "--systems", "pushkv", "--scenarios", "nocache"]
    )
    assert cfg.kill_prefill_at_s == 5.0


def test_the_plot_goes_into_the_source_tree_only_when_named(tmp_path: Path) -> None:
    """`--quick` once rewrote the tracked docs/bench_ttft.png: the plot goes
    where --plot names, else beside --out's figures, else into a new
    temporary directory."""
    root = Path(__file__).resolve().parent.parent
    assert _parse(["--quick"])[1].plot is None
    default = plot_path(None, None)
    assert default.name == "bench_ttft.png" and default.parent.is_dir()
    assert not default.resolve().is_relative_to(root), default
    assert plot_path(None, tmp_path) == tmp_path / "bench_ttft.png"
    named = Path("docs/bench_ttft.png")
    assert plot_path(named, tmp_path) == named
    default.parent.rmdir()


# ------------------------------------------------------------ first-token


def _rec(
    i: int, ttft_ms: float, ttst_ms: float, *, rid: str = "", sent_unix: float = 0.0
) -> ReqRecord:
    sent = float(i)
    return ReqRecord(
        i,
        128,
        sent=sent,
        first=sent + ttft_ms / 1000,
        second=sent + ttst_ms / 1000,
        last=sent + (ttst_ms + 30) / 1000,
        tokens=8,
        sent_unix=sent_unix or 1000.0 + 10 * i,
        response_id=rid,
        first_event_tokens=2 if ttst_ms == ttft_ms else 1,
    )


def test_first_token_ratios_and_its_last_line() -> None:
    pk = [_rec(i, t, s) for i, (t, s) in enumerate([(30, 40), (50, 60), (40, 50)])]
    single = [_rec(i, t, s) for i, (t, s) in enumerate([(20, 25), (25, 25), (30, 35)])]
    single.append(ReqRecord(3, 128, sent=3.0, error="HTTP 500: boom"))
    summary = first_token.summarize({"pushkv": pk, "single": single}, [4.0, 6.0, 5.0])
    assert summary.systems["pushkv"].ttft_ms["p50"] == pytest.approx(40.0)
    assert summary.systems["single"].ttst_ms["p50"] == pytest.approx(25.0)
    assert summary.ratios["ttft_p50"] == pytest.approx(40 / 25)
    assert summary.ratios["ttst_p50"] == pytest.approx(50 / 25)
    assert first_token.final_line(summary) == (
        "ttft_p50_ratio_vs_single=1.600 ttst_p50_ratio_vs_single=2.000 handover_p50_ms=5.00"
    )
    cfg = _parse(["--quick", "--scenario", "first-token"])[0]
    lines = first_token.report_lines(cfg, summary)
    assert "| pushkv | 3/3 | 40.0 / 49.8 | 50.0 / 59.8 | 10.0 / 10.0 | 0 |" in lines
    assert "| single | 3/4 | 25.0 / 29.9 | 25.0 / 34.8 | 5.0 / 5.0 | 1 |" in lines
    assert "  single errors: ['HTTP 500: boom']" in lines
    # A system that did not run: nan, never a ratio against nothing.
    down = first_token.summarize({"pushkv": pk}, [])
    assert first_token.final_line(down) == (
        "ttft_p50_ratio_vs_single=nan ttst_p50_ratio_vs_single=nan handover_p50_ms=nan"
    )
    assert "| single | FAILED: did not start |||||" in first_token.report_lines(
        cfg, down, {"single": "did not start"}
    )


def test_the_decode_handover_is_found_by_id_or_else_by_time() -> None:
    from pushkv.router.timings import DECODE_FIRST_BYTE, PREFILL_RESPONSE

    by_id = _rec(0, 30, 40, rid="cmpl-tx-a", sent_unix=100.0)
    by_time = _rec(1, 30, 40, rid="cmpl-other", sent_unix=200.0)
    lost = _rec(2, 30, 40, rid="", sent_unix=300.0)
    front = {
        "tx-a": {PREFILL_RESPONSE: 100.020, DECODE_FIRST_BYTE: 100.025},
        # a front that names the request otherwise: its marks within the request
        "tx-b": {PREFILL_RESPONSE: 200.010, DECODE_FIRST_BYTE: 200.008},  # decode first
        # two candidates inside request 2's span: ambiguous, not taken
        "tx-c": {PREFILL_RESPONSE: 300.010, DECODE_FIRST_BYTE: 300.020},
        "tx-d": {PREFILL_RESPONSE: 300.011, DECODE_FIRST_BYTE: 300.021},
        "tx-e": {PREFILL_RESPONSE: 400.0},  # one mark only: never a handover
    }
    got, missing = first_token.handovers_ms([by_id, by_time, lost], front)
    assert got == pytest.approx([5.0, -2.0])
    assert missing == 1


def test_a_streamed_event_counts_its_tokens_not_one() -> None:
    # vLLM merges the outputs its API server has not sent yet into one event.
    merged = {"choices": [{"text": "ab"}], "usage": {"completion_tokens": 2}}
    assert event_tokens(merged, 0) == (2, 2)
    assert event_tokens({"choices": [{"text": "c"}], "usage": {"completion_tokens": 3}}, 2) == (
        1,
        3,
    )
    # An event a front writes itself (no usage), then the engine's own count.
    assert event_tokens({"choices": [{"text": "a"}]}, 0) == (1, 0)
    assert event_tokens({"choices": [{"text": "b"}], "usage": {"completion_tokens": 1}}, 0) == (
        1,
        1,
    )
    assert event_tokens({"choices": [{"token_ids": [5, 6, 7]}]}, 0) == (3, 0)


def test_first_token_sends_every_prompt_to_both_systems_alternating_who_goes_first() -> None:
    order = first_token.schedule(4)
    assert order == [
        (0, "pushkv"),
        (0, "single"),
        (1, "single"),
        (1, "pushkv"),
        (2, "pushkv"),
        (2, "single"),
        (3, "single"),
        (3, "pushkv"),
    ]
    cfg = _parse(["--quick", "--scenario", "first-token"])[0]
    prompts = first_token.ladder(cfg, 8)
    assert sorted(len(p) for p in prompts) == [128, 256, 384, 512, 640, 768, 896, 1024]
    assert prompts == first_token.ladder(cfg, 8)  # seeded
    with pytest.raises(ValueError, match="at least 2 requests"):
        first_token.ladder(cfg, 1)


def test_first_token_has_its_own_defaults_and_runs_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg, _ = _parse(["--quick", "--scenario", "first-token"])
    assert (cfg.scenarios, cfg.systems, cfg.rates) == (("first-token",), ("pushkv", "single"), ())
    assert (cfg.layers, cfg.hidden, cfg.min_prompt, cfg.max_prompt) == (2, 128, 128, 1024)
    assert (cfg.output_len, cfg.min_requests) == (8, first_token.QUICK_REQUESTS)
    assert _parse(["--scenarios", "first-token"])[0].min_requests == first_token.FULL_REQUESTS
    # the rate scenarios keep theirs
    cfg, _ = _parse(["--quick", "--scenario", "nocache"])
    assert (cfg.scenarios, cfg.layers, cfg.max_prompt, cfg.output_len) == (
        ("nocache",),
        4,
        3072,
        64,
    )
    for bad, why in (
        (["--scenario", "first-token", "--rates", "1"], "it takes no --rates"),
        (["--scenario", "first-token", "--systems", "pull"], "it takes no --systems"),
        (["--scenarios", "nocache,first-token"], "'first-token' runs alone"),
        (["--scenario", "nocache", "--scenarios", "nocache"], "not allowed with argument"),
        (["--scenario", "first-token", "--min-requests", "1"], "at least 2"),
        (["--min-prompt", "900", "--max-prompt", "800"], "want 0 < --min-prompt <= --max-prompt"),
    ):
        with pytest.raises(SystemExit):
            _parse(bad)
        assert why in capsys.readouterr().err, bad


def test_the_rate_table_shows_the_time_to_the_second_token() -> None:
    runs = _runs(vllm_push_sustains_2=False)
    runs["pushkv"].rates[1].ttst_ms = {"p50": 321.0, "p90": 400.0, "p99": 500.0}
    lines = report(_cfg(tuple(runs)), {"nocache": runs})
    assert any("TTFT p50 / p90 / p99 (ms) | TTST p50 (ms) |" in x for x in lines)
    assert any(x.startswith("| 1 | pushkv | 10/10 |") and "| 321 |" in x for x in lines)
    # From the records: the second token's arrival, merged events included.
    recs = [_rec(0, 30, 30), _rec(1, 50, 70)]
    assert summarize(1.0, recs).ttst_ms["p50"] == pytest.approx(50.0)
