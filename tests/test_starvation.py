"""An agent whose host process keeps its threads from running says so
(agent/starvation.py): the link's watchdog logs each stall, and with a hang
dump asked for, faulthandler's own thread writes every Python thread's stack
while the stall lasts.

The stalls here are real: the test holds the GIL in a C call (ctypes.PyDLL
calls keep it) blocked on a pipe, as a C extension that keeps the GIL while
it waits would."""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import subprocess
import sys
import textwrap

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pushkv.agent.link import CoordinatorLink
from pushkv.agent.messages import CoordinatorLostMsg, Inbound, LeaseLapsedMsg
from pushkv.agent.starvation import STARVED_S, StarvationWatch
from pushkv.controlplane.server import Coordinator
from pushkv.harness.coordinator import CoordinatorProcess, RelayProcess
from pushkv.net.event_loop import STALL_S
from pushkv.net.silence import WATCH_S
from tests.support.sim_agent import hello
from tests.support.waits import Lines, poll, wait_until

WAIT_S = 30.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_wake_on_time_is_no_stall_and_a_late_one_is_measured() -> None:
    clock = FakeClock()
    watch = StarvationWatch(0.1, clock=clock)
    for _ in range(5):
        clock.now += 0.1 + 0.05  # a little late: a loaded machine, not a stall
        assert watch.tick() == 0.0
    clock.now += 0.1 + 3.0
    assert watch.tick() == pytest.approx(3.0)
    clock.now += 0.1 + 2.5
    assert watch.tick() == pytest.approx(2.5)
    assert watch.stalls == 2 and watch.longest_s == pytest.approx(3.0)


def test_a_long_step_of_the_watchdog_is_not_a_stall() -> None:
    """Asking another replica who leads may block the watchdog's step:
    `stepped` starts the next wait after it."""
    clock = FakeClock()
    watch = StarvationWatch(0.1, clock=clock)
    clock.now += 0.1
    assert watch.tick() == 0.0
    clock.now += STARVED_S * 2  # the step itself
    watch.stepped()
    clock.now += 0.1
    assert watch.tick() == 0.0 and watch.stalls == 0


def stall_this_process(seconds: float) -> None:
    """Keep every other thread of this process from running for `seconds`:
    block in read(2) on a pipe that a child writes to after them, without
    releasing the GIL (ctypes.PyDLL calls keep it). Blocks its caller too,
    event loop included: that is the fault."""
    buf = ctypes.create_string_buffer(1)
    with subprocess.Popen(["sh", "-c", f"sleep {seconds}; printf x"], stdout=subprocess.PIPE) as w:
        assert w.stdout is not None
        assert ctypes.PyDLL(None).read(w.stdout.fileno(), buf, 1) == 1


async def test_the_link_logs_a_process_that_starved_it(
    coord: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pushkv.agent")
    inbound: list[Inbound] = []
    link = CoordinatorLink(coord.address, hello("p0", "prefill").hello, inbound.append)
    try:
        link.start()
        assert await asyncio.to_thread(link.registered.wait, WAIT_S)
        stall_this_process(STARVED_S + 0.5)  # the fault's length, not a wait
        # The watchdog's next wake (WATCH_S after the GIL is back) sees it.
        await asyncio.to_thread(
            wait_until, lambda: link.starvation.stalls > 0, "the stall seen", WAIT_S, WATCH_S
        )
    finally:
        await asyncio.to_thread(link.stop)
    # At least this stall (a loaded machine may add one of its own).
    assert link.starvation.stalls >= 1
    assert link.starvation.longest_s >= STARVED_S + 0.5 - WATCH_S
    lines = [
        r.getMessage()
        for r in caplog.records
        if "the agent's threads could not run for" in r.getMessage()
    ]
    assert lines and all("this process starved them" in ln for ln in lines), lines


@pytest.mark.parametrize("silent_agent_s", ["30", "2"], ids=["kept", "without-the-rule"])
def test_a_starved_agent_keeps_its_registration_past_its_lease(silent_agent_s: str) -> None:
    """This process holds the GIL for twice the agent's lease. Its gRPC
    threads answer the coordinator's keepalive pings meanwhile, so the
    coordinator keeps the agent (silent_agent_s): no reconnect, and the first
    heartbeat answered after the stall renews the lease, so nothing lapsed
    and nothing held is dropped. With silent_agent_s at the lease (the rule
    off) the same stall costs the registration. A frozen process, whose pings
    go unanswered, is lost as before (test_faults_vllm's frozen prefill)."""
    coord = CoordinatorProcess(
        "--lease-s", "2", "--heartbeat-interval-s", "0.5", "--silent-agent-s", silent_agent_s
    ).start()
    inbound: list[Inbound] = []
    link = CoordinatorLink(coord.address, hello("p0", "prefill").hello, inbound.append)
    try:
        link.start()
        assert link.registered.wait(WAIT_S)
        stall_this_process(4.0)  # the fault's length, not a wait
        wait_until(lambda: link.starvation.stalls > 0, "the stall seen", WAIT_S, WATCH_S)
        wait_until(link.lease_ok, "the lease held again", WAIT_S, WATCH_S)
        lapsed = [m for m in inbound if isinstance(m, CoordinatorLostMsg | LeaseLapsedMsg)]
        if silent_agent_s == "2":
            poll("the agent welcomed back", lambda: link.connects == 2, WAIT_S)
            assert lapsed
            return
        assert (link.connects, link.silenced, link.failed_attempts, lapsed) == (1, 0, 0, [])
    finally:
        link.stop()
        coord.stop()


CHILD = textwrap.dedent(
    """
    import ctypes, sys, threading
    from pushkv.agent.starvation import StarvationWatch
    watch = StarvationWatch(0.05, dump_after_s=1.0, starved_s=0.5)
    stop, ticked = threading.Event(), threading.Event()
    def watchdog():
        while not stop.wait(0.05):
            late = watch.tick()  # the first tick arms the dump
            ticked.set()
            if late:
                print(f"stalled {late:.1f}", flush=True)
                stop.set()
        watch.close()
    def held_in_c(fd):  # a frame the dump must show
        buf = ctypes.create_string_buffer(1)
        ctypes.PyDLL(None).read(fd, buf, 1)
    t = threading.Thread(target=watchdog, name="watchdog")
    t.start()
    assert ticked.wait(30)
    print("holding", flush=True)
    held_in_c(sys.stdin.fileno())
    t.join(30)
    print("done", flush=True)
    """
)


def held_child(script: str, frame: str) -> tuple[str, float]:
    """Run `script`, which prints "holding" and then holds the GIL in a C
    call named `frame` until this writes to its stdin: the dump it wrote
    while held (read before it is let go), and the stall it then logged."""
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    out, err = Lines(child.stdout), Lines(child.stderr)
    try:
        out.until("holding", WAIT_S)
        dump = err.until(frame, WAIT_S)  # before the child is let go
        child.stdin.write("x")
        child.stdin.flush()
        stalled = float(out.until("stalled", WAIT_S).split()[-1])
        out.until("done", WAIT_S)
        assert child.wait(WAIT_S) == 0
        return dump, stalled
    finally:
        child.kill()
        child.wait(WAIT_S)


def test_a_hang_dump_shows_every_thread_while_the_gil_is_held() -> None:
    """The dump comes from faulthandler's thread while the GIL is still held
    (the parent lets the child go only once it read the dump), then the
    watchdog, running again, logs the stall."""
    dump, stalled = held_child(CHILD, "held_in_c")
    assert "Thread 0x" in dump and "in watchdog" in dump, dump
    assert stalled >= 0.5


LOOP_CHILD = textwrap.dedent(
    """
    import asyncio, ctypes, sys
    from pushkv.net.event_loop import report_stalls
    def held_on_the_loop(fd):  # a frame the dump must show
        buf = ctypes.create_string_buffer(1)
        ctypes.PyDLL(None).read(fd, buf, 1)
    async def main():
        reported = asyncio.Event()
        def report(s):
            print(f"stalled {s:.1f}", flush=True)
            reported.set()
        stalls = asyncio.ensure_future(report_stalls(report, stall_s=0.5, dump_after_s=1.0))
        await asyncio.sleep(0)  # one step: the task's first tick arms the dump, then waits
        print("holding", flush=True)
        held_on_the_loop(sys.stdin.fileno())
        await asyncio.wait_for(reported.wait(), 30)  # the tick after the hold reports it
        stalls.cancel()  # cancels the dump timer too
        await asyncio.gather(stalls, return_exceptions=True)
        print("done", flush=True)
    asyncio.run(main())
    """
)


def test_a_stalled_event_loop_has_its_threads_dumped_while_the_stall_lasts() -> None:
    """pushkv/net/event_loop.report_stalls with a hang dump (the coordinator's
    --hang-dump-s): a loop held in a C call that keeps the GIL has every
    thread's stack written before it runs again, then logs the stall."""
    dump, stalled = held_child(LOOP_CHILD, "held_on_the_loop")
    assert "Current thread 0x" in dump or "Thread 0x" in dump, dump
    assert stalled >= 0.5


@pytest.mark.parametrize("value", ["-1", "nan", "1e9"])
def test_a_coordinator_refuses_a_hang_dump_wait_out_of_range(value: str) -> None:
    with pytest.raises(RuntimeError, match=r"--hang-dump-s: .* is not within 0"):
        CoordinatorProcess("--hang-dump-s", value).start()


def freeze_past_stall(proc: CoordinatorProcess) -> None:
    """SIGSTOP `proc` for longer than STALL_S (a paused host looks the same):
    the fault's length is a health call to it left unanswered that long."""
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(proc.address))
    health.Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
    proc.freeze()
    try:
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(), timeout=STALL_S + 0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        proc.thaw()


def test_a_coordinator_kept_from_running_logs_the_stall() -> None:
    """The coordinator's side (pushkv/net/event_loop.report_stalls): frozen, then
    let go, it logs how long its event loop did not run."""
    coord = CoordinatorProcess("--log-level", "WARNING").start()
    try:
        freeze_past_stall(coord)

        def stalls() -> list[dict[str, object]]:
            lines = [json.loads(ln) for ln in coord.log_text().splitlines() if ln.startswith("{")]
            return [ln for ln in lines if ln["event"] == "coordinator_stalled"]

        stall = max(
            poll("the coordinator's stall in its log", stalls, WAIT_S),
            key=lambda ln: float(str(ln["seconds"])),
        )
        assert stall["level"] == "warning" and float(str(stall["seconds"])) >= STALL_S
        assert "heard nothing meanwhile" in str(stall["detail"])
    finally:
        coord.stop()


def test_a_relay_kept_from_running_logs_the_stall() -> None:
    coord = CoordinatorProcess("--log-level", "WARNING").start()
    relay = RelayProcess(coord.address).start()
    try:
        freeze_past_stall(relay)

        def stalls() -> list[dict[str, object]]:
            entries = [json.loads(ln) for ln in relay.log_text().splitlines() if ln.startswith("{")]
            return [e for e in entries if e.get("event") == "event_loop_stalled"]

        found = poll("the relay's stall in its log", stalls, WAIT_S)
        stall = max(found, key=lambda e: float(str(e["seconds"])))
        assert float(str(stall["seconds"])) >= STALL_S, stall
        assert stall["level"] == "warning"
        assert "did not run its event loop" in str(stall["detail"])
    finally:
        relay.stop()
        coord.stop()
