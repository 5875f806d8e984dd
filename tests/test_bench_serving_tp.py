"""`pushkv bench serving --prefill-tp 2`: a TP2 prefill engine into a TP1 decode
engine. Its settings, what it refuses, the engines each system would start and
the report's topology line; no engine is started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pushkv.bench.serving import deployment
from pushkv.bench.serving.config import (
    HETERO_TP_SYSTEMS,
    SYSTEMS,
    TP2_COORDINATOR_FLAGS,
    BenchConfig,
)
from pushkv.bench.serving.deployment import Deployment
from pushkv.bench.serving.main import _parse
from pushkv.bench.serving.processes import worker_schedstat
from pushkv.bench.serving.report import report
from pushkv.bench.serving.results import RateResult, SystemRun
from pushkv.harness.vllm_server import PushkvCluster


def test_the_default_run_stays_tp1() -> None:
    cfg, _ = _parse(["--quick"])
    assert cfg.prefill_tp == 1
    assert cfg.systems == SYSTEMS


def test_prefill_tp2_runs_the_systems_that_take_it() -> None:
    cfg, _ = _parse(["--quick", "--prefill-tp", "2"])
    assert cfg.prefill_tp == 2
    assert cfg.systems == HETERO_TP_SYSTEMS == ("pull", "pushkv", "single")
    cfg, _ = _parse(["--prefill-tp", "2", "--systems", "pushkv,single"])
    assert cfg.systems == ("pushkv", "single")


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--systems", "pushkv,vllm-push"], "runs only"),
        (["--systems", "pull-noprog"], "runs only"),
        (["--hidden", "64"], "1 KV heads do not divide by 2"),  # 2 heads, 1 KV head
        (["--hidden", "96"], "hidden must be a positive multiple"),
        (["--pin", "engines"], "use --pin workers"),
        (["--kill-prefill-at", "5", "--systems", "pushkv", "--rates", "1"], "TP1 prefill"),
    ],
)
def test_prefill_tp2_refuses(args: list[str], why: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--quick", "--prefill-tp", "2", *args])
    assert why in capsys.readouterr().err


def test_only_tp1_and_tp2_are_known(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--prefill-tp", "4"])
    assert "invalid choice" in capsys.readouterr().err


def test_pushkv_cluster_prefill_tp2_decode_tp1() -> None:
    cluster = PushkvCluster.around(
        "127.0.0.1:1", Path("/nonexistent"), prefill_tp=2, block_size=128
    )
    assert (cluster.prefill.tp_size, cluster.decode.tp_size) == (2, 1)
    assert cluster.prefill.block_size == cluster.decode.block_size == 128
    default = PushkvCluster.around("127.0.0.1:1", Path("/nonexistent"))
    assert (default.prefill.tp_size, default.decode.tp_size) == (1, 1)


class _FakeServer:
    made: list[dict[str, Any]] = []

    def __init__(self, model_dir: Path, name: str, **kw: Any) -> None:
        self.name, self.url = name, f"http://{name}"
        _FakeServer.made.append({"name": name, **kw})

    def start(self) -> None: ...

    def wait_ready(self, timeout: float) -> None: ...


class _FakeChild:
    def __init__(self, *args: Any) -> None: ...

    def start(self) -> None: ...


def test_pull_starts_a_tp2_producer_and_a_tp1_consumer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(deployment, "VllmServer", _FakeServer)
    monkeypatch.setattr(deployment, "ChildProcess", _FakeChild)
    _FakeServer.made = []
    cfg = BenchConfig(model_dir=tmp_path, prefill_tp=2)
    deployment._deploy_vllm_nixl(cfg, Deployment("pull", "nocache"), {})
    got = {m["name"]: (m["tp_size"], m["kv_transfer_config"]["kv_role"]) for m in _FakeServer.made}
    assert got == {"prefill": (2, "kv_producer"), "decode": (1, "kv_consumer")}


def test_pushkv_tp2_gets_the_longer_coordinator_lease(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    flags: list[tuple[str, ...]] = []

    class Stop(Exception):
        pass

    class FakeCoordinator:
        def __init__(self, *args: str, host: str) -> None:
            assert host == "127.0.0.1"  # the loopback placement
            flags.append(args)

        def start(self) -> None:
            raise Stop

        def stop(self) -> None: ...

    monkeypatch.setattr(deployment, "CoordinatorProcess", FakeCoordinator)
    for tp in (1, 2):
        with pytest.raises(Stop):
            deployment._deploy_pushkv(
                BenchConfig(model_dir=tmp_path, prefill_tp=tp), Deployment("pushkv", "nocache"), {}
            )
    assert not set(TP2_COORDINATOR_FLAGS) & set(flags[0])
    assert flags[1][: len(TP2_COORDINATOR_FLAGS)] == TP2_COORDINATOR_FLAGS


def _run(system: str) -> SystemRun:
    run = SystemRun(system, "nocache")
    q = {"p50": 100.0, "p90": 200.0, "p99": 300.0}
    run.rates = [RateResult(1.0, 10, 10, 0, 0, 1.0, 1.0, 1.0, q, q, 200.0, True)]
    return run


def test_the_report_states_the_topology() -> None:
    runs = {"nocache": {s: _run(s) for s in HETERO_TP_SYSTEMS}}
    tp2 = report(BenchConfig(model_dir=Path("/x"), rates=(1.0,), prefill_tp=2), runs)
    assert any(ln.startswith("topology: prefill TP2") and "decode TP1" in ln for ln in tp2)
    tp1 = report(BenchConfig(model_dir=Path("/x"), rates=(1.0,)), runs)
    assert any(ln.startswith("topology: prefill TP1 (core 0) into decode TP1") for ln in tp1)


def test_worker_schedstat_reads_tp_ranks_too() -> None:
    # vLLM titles a TP rank's worker "VLLM::Worker_TP<r>"; comm keeps 15 bytes.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "open('/proc/self/comm', 'w').write('VLLM::Worker_TP1')\n"
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
        assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "VLLM::Worker_TP"
        run, _wait = worker_schedstat([child.pid])
        assert run > 10_000_000
    finally:
        child.kill()
        child.wait(10)


def test_a_step_budget_reaches_every_engine_and_is_checked() -> None:
    cfg, _ = _parse(["--quick", "--step-tokens", "512"])
    assert cfg.step_tokens == 512
    opts = deployment._options(cfg, "nocache", {})
    assert opts["extra_args"][-2:] == ("--max-num-batched-tokens", "512")
    whole, _ = _parse(["--quick"])
    assert "--max-num-batched-tokens" not in deployment._options(whole, "nocache", {})["extra_args"]
    with pytest.raises(SystemExit):
        _parse(["--quick", "--step-tokens", "64"])  # under a 128-token block
