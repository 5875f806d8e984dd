"""`pushkv bench coordinator`'s counting rules: only COMPLETE transfers count
toward rendezvous/s, and order latency starts at the send of the completing
call. No timing is asserted: the figures are computed from given times, or
only their counts are checked."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from typing import Any

import grpc

from pushkv.bench.coordinator import build_parser, modes
from pushkv.bench.coordinator_agents import Ledger, _agents
from pushkv.bench.coordinator_load import ClientReport
from pushkv.bench.coordinator_report import final_line, summary
from pushkv.bench.coordinator_runs import Memory, Run
from pushkv.bench.coordinator_step import Step, measure_step
from pushkv.bench.coordinator_workload import (
    COMPLETE,
    CORE_SETTINGS,
    decode_request,
    prefill_request,
)
from pushkv.controlplane.server import ServerSettings, start
from pushkv.controlplane.settings import CoreSettings
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

FAILED = pb.TRANSFER_STATE_FAILED


def report(sent: dict[str, float], t0: float = 0.0, t_end: float = 10.0, **kw: Any) -> ClientReport:
    base: dict[str, Any] = dict(issued=len(sent), dropped=0, errors={}, rpcs=2 * len(sent))
    base.update(kw)
    return ClientReport(
        t0,
        t_end,
        base["issued"],
        base["dropped"],
        sent,
        base["errors"],
        base["rpcs"],
        base.get("calls", base["rpcs"]),
    )


def test_complete_is_the_protocol_state() -> None:
    assert COMPLETE == pb.TRANSFER_STATE_COMPLETE


def test_only_complete_transfers_count_toward_the_rate() -> None:
    sent = {f"s-{i}": 1.0 for i in range(10)}
    ends = {f"s-{i}": (2.0, COMPLETE) for i in range(6)}
    ends.update({f"s-{i}": (2.0, FAILED) for i in range(6, 9)})  # s-9 never ended
    step = measure_step(100.0, [report(sent, 0.0, 4.0)], {}, ends)
    assert step.completed == 6
    assert step.failed == 3
    assert step.unfinished == 1
    assert step.completed_per_s == 6 / 4.0
    assert step.saturated  # 1.5/s of 100 offered


def test_ordered_or_issued_is_not_completed() -> None:
    sent = {f"s-{i}": 1.0 for i in range(5)}
    ordered = {tid: 1.5 for tid in sent}
    step = measure_step(5.0, [report(sent, 0.0, 1.0)], ordered, {})
    assert step.issued == 5
    assert step.completed == 0
    assert step.completed_per_s == 0.0
    assert step.unfinished == 5


def test_completions_after_the_offer_do_not_count_toward_the_rate() -> None:
    sent = {"s-0": 0.5, "s-1": 0.5}
    ends = {"s-0": (1.0, COMPLETE), "s-1": (3.0, COMPLETE)}  # s-1 after t_end
    step = measure_step(1.0, [report(sent, 0.0, 2.0)], {}, ends)
    assert step.completed == 2
    assert step.completed_per_s == 1 / 2.0


def test_order_latency_starts_at_the_send_of_the_completing_call() -> None:
    a = report({"s-0": 1.000, "s-1": 2.000}, 0.0, 3.0)
    b = report({"s-2": 1.500}, 0.5, 3.0)
    ordered = {"s-0": 1.002, "s-1": 2.010, "s-2": 1.5005, "other": 0.0}
    step = measure_step(1.0, [a, b], ordered, {})
    assert sorted(round(x, 6) for x in step.order_ms) == [0.5, 2.0, 10.0]


def test_batch_size_is_calls_per_rpc() -> None:
    sent = {f"s-{i}": 1.0 for i in range(240)}
    step = measure_step(1.0, [report(sent, rpcs=4, calls=480)], {}, {})
    assert step.calls_per_rpc == 120


def test_ledger_failure_wins_and_each_transfer_ends_once() -> None:
    led = Ledger()
    for tid in ("s-0", "s-1", "s-2"):
        led.order(tid, 1.0)
        led.report_applied(tid, 1.1)  # DONE applied
    led.report_applied("s-0", 1.2)  # ... and the arrival: COMPLETE
    led.report_applied("s-1", 1.2)
    led.fail("s-1", 1.3, FAILED)  # then a failure notice for s-1
    led.fail("s-3", 1.3, FAILED)  # never ordered
    led.order("t-0", 1.0)
    assert led.ended("s-") == 3  # s-0, s-1 (once), s-3; s-2 is half confirmed
    ordered, ends = led.collect("s-")
    assert set(ordered) == {"s-0", "s-1", "s-2"}
    assert ends == {"s-0": (1.2, COMPLETE), "s-1": (1.3, FAILED), "s-3": (1.3, FAILED)}
    assert led.ended("s-") == 0
    assert set(led.ordered) == {"t-0"}


async def test_simulated_agents_count_cancelled_transfers_as_not_complete() -> None:
    """Through a real coordinator: 4 rendezvous complete, 3 are cancelled."""
    coord = await start(ServerSettings(port=0, core=CoreSettings(**CORE_SETTINGS)))
    parent, child = mp.Pipe()
    agents = asyncio.create_task(_agents(child, coord.address, True))

    async def ask(*cmd: Any) -> Any:
        parent.send(cmd)
        return await asyncio.to_thread(parent.recv)

    try:
        assert await asyncio.to_thread(parent.recv) == "ready"
        async with grpc.aio.insecure_channel(coord.address) as ch:
            stub: Any = pbg.TransferServiceStub(ch)
            sent: dict[str, float] = {}
            t0 = time.monotonic()
            for i in range(7):
                tid = f"x-{i}"
                await stub.RegisterDecodeBlocks(decode_request(tid), timeout=10)
                if i < 4:
                    sent[tid] = time.monotonic()
                    await stub.ReportPrefillDone(prefill_request(tid), timeout=10)
                else:
                    await stub.Cancel(pb.CancelRequest(transfer_id=tid, reason="test"), timeout=10)
            t_end = time.monotonic()
            for _ in range(200):  # bounded wait for the barriers and notices
                if await ask("count", "x-") >= 7:
                    break
                await asyncio.sleep(0.02)
            ordered, ends, (checked, wrong) = await ask("collect", "x-")
        step = measure_step(7.0, [report(sent, t0, time.monotonic(), issued=7)], ordered, ends)
        assert t_end > t0
        assert step.completed == 4
        assert step.failed == 3
        assert {s for _, s in ends.values()} == {COMPLETE, pb.TRANSFER_STATE_CANCELLED}
        assert len(step.order_ms) == 4
        assert all(ms >= 0 for ms in step.order_ms)  # receipt after the send
        assert (checked, wrong) == (4, 0)
    finally:
        parent.send(("quit",))
        await asyncio.wait_for(agents, 10)
        await coord.stop(0)


def test_modes_and_their_flags() -> None:
    p = build_parser()
    assert modes(p.parse_args([])) == ["unbatched", "batched"]
    assert modes(p.parse_args(["--batched-only"])) == ["batched"]
    assert modes(p.parse_args(["--unbatched-only"])) == ["unbatched"]
    assert modes(p.parse_args(["--batch", "0"])) == ["unbatched"]
    assert modes(p.parse_args(["--modes", "batched,unbatched"])) == ["unbatched", "batched"]


def test_the_summary_says_batched_its_batch_size_and_simulated_agents() -> None:
    def step(rate: float, rpcs: int, calls: int) -> Step:
        return Step(offered=rate, completed_per_s=rate, rpcs=rpcs, calls=calls, order_ms=[1.0])

    batched = Run("batched", 256, [step(1000, 10, 1200)], step(500, 10, 600), "core: pure Python")
    unbatched = Run("unbatched", 0, [step(100, 200, 200)], step(50, 100, 100), "core: pure Python")
    unbatched.saturated = True
    memory = Memory(0, 1000, 10, None, "core: pure Python")
    line = final_line([unbatched, batched], memory)
    assert "agents=simulated_no_bytes" in line
    assert "batch_calls_per_rpc=120" in line and "batch_max=256" in line
    assert "rendezvous_per_s_batched=1000" in line and "rendezvous_per_s_unbatched=100" in line
    assert "batched_over_unbatched=10.0" in line
    assert "saturated_batched=no_lower_bound" in line
    assert "saturated_unbatched=yes" in line
    text = "\n".join(summary([unbatched, batched], memory))
    assert "move no bytes" in text
    assert "batched (Submit of 120 calls per RPC" in text
    assert "unbatched (1 call per RPC)" in text
    assert "at least 1000 rendezvous/s reached COMPLETE" in text
