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

from pushkv.bench.serving.config import BenchConfig
from pushkv.bench.serving.main import _parse, plot_path
from pushkv.bench.serving.processes import worker_schedstat
from pushkv.bench.serving.report import final_line, report, single_floor
from pushkv.bench.serving.results import RateResult, SystemRun
from pushkv.bench.serving.vllm_patches import sitecustomize

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
    from pushkv.bench.serving.workload import ReqRecord

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
