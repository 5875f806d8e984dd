"""The coordinator's clock under load: how often its tick wakes, and what the
tick costs, with 1,000 agents (``python -m pushkv.bench.tick_wakeups``).

Drives one `Rendezvous` (the default settings) on a fake clock in 1 ms steps:
`--rate` TP-8 rendezvous per second (register, prefill done, every order
posted, done and arrived at once), each of the 1,000 agents' heartbeats once
a second, and the tick loop of `controlplane/runtime.py` (tick, then sleep
until the next wakeup, at least 5 ms, at most 0.25 s). The first `--warmup`
simulated seconds (past the rendezvous timeout, 60 s, so that the deadlines
the first transfers left behind come due) are not counted; then, over
`--seconds`, it prints the ticks per simulated second and the thread CPU
time the ticks and their wakeup computations take, per simulated second and
per tick, median (range) over `--reps` repetitions. Only the clock's part is
timed; the rendezvous themselves are not.

What it leaves out: the network, the event loop, the observers, and every
transfer ending at once (each leaves its deadlines behind: the rendezvous
timeout at registration, the write timeout at its orders).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

TP = 8
ENGINES = 125  # 62 prefill + 63 decode engines of 8 ranks: 1,000 agents
STEP_S = 0.001


def _one_rep(rate: float, seconds: float, warmup: float) -> dict[str, float]:
    from pushkv.controlplane.clock import FakeClock
    from pushkv.controlplane.domain import (
        AgentKey,
        AgentRegistration,
        EngineId,
        KVLayout,
        KVRegion,
        Role,
        SendOrder,
        WriteStatus,
    )
    from pushkv.controlplane.rendezvous import Rendezvous
    from pushkv.controlplane.runtime import TICK_MAX_S, TICK_MIN_S
    from pushkv.controlplane.settings import CoreSettings

    clock = FakeClock()
    rv = Rendezvous(CoreSettings(max_inflight=1_000_000, max_inflight_per_engine=1_000_000), clock)
    layout = KVLayout(16, (KVRegion(0x1000, 4096, 4096),))
    engines: dict[Role, list[EngineId]] = {Role.PREFILL: [], Role.DECODE: []}
    agents: list[AgentKey] = []
    for e in range(ENGINES):
        role = Role.PREFILL if e % 2 == 0 else Role.DECODE
        eid = EngineId(f"{role.value}-{e}")
        engines[role].append(eid)
        for r in range(TP):
            rv.agent_hello(AgentRegistration(eid, role, r, TP, "i1", f"{eid}-{r}", b"m", layout))
            agents.append(AgentKey(eid, r))
    start = clock.monotonic()
    first = int(warmup / STEP_S)
    steps = first + int(seconds / STEP_S)
    next_tick, done, beat = start, 0, 0
    ticks, cpu = 0, 0.0
    for step in range(1, steps + 1):
        clock.advance(STEP_S)
        now = clock.monotonic()
        for _ in range(int(step * STEP_S * len(agents)) - beat):  # once a second each
            rv.agent_seen(agents[beat % len(agents)], "i1")
            beat += 1
        for _ in range(int(step * STEP_S * rate) - done):
            tid = f"t{done}"
            p = engines[Role.PREFILL][done % len(engines[Role.PREFILL])]
            d = engines[Role.DECODE][done % len(engines[Role.DECODE])]
            rv.register_decode(tid, d, [[1, 2, 3]], 40)
            _, effects = rv.prefill_done(tid, p, [[4, 5, 6]], 40)
            for o in (e for e in effects if isinstance(e, SendOrder)):
                oid = o.order.order_id
                rv.write_report(o.to, "i1", oid, tid, WriteStatus.POSTED)
                rv.write_report(o.to, "i1", oid, tid, WriteStatus.DONE)
                for tgt in o.order.targets:
                    rv.arrival_report(
                        AgentKey(tgt.decode_engine_id, tgt.decode_rank),
                        "i1",
                        tid,
                        [o.order.prefill_rank],
                    )
            done += 1
        if now >= next_tick:
            t0 = time.thread_time()
            rv.tick()
            nxt = rv.next_wakeup()
            if step > first:
                cpu += time.thread_time() - t0
                ticks += 1
            delay = TICK_MAX_S if nxt is None else min(max(nxt - now, TICK_MIN_S), TICK_MAX_S)
            next_tick = now + delay
    assert all(rv.get(f"t{i}").state.terminal for i in range(done)), "a rendezvous did not end"
    return {
        "ticks_per_s": ticks / seconds,
        "tick_cpu_us_per_s": cpu / seconds * 1e6,
        "us_per_tick": cpu / ticks * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=500.0, help="TP-8 rendezvous per second")
    ap.add_argument("--seconds", type=float, default=10.0, help="simulated seconds")
    ap.add_argument("--warmup", type=float, default=61.0, help="simulated seconds not counted")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    runs: list[dict[str, Any]] = [
        _one_rep(args.rate, args.seconds, args.warmup) for _ in range(args.reps)
    ]
    print(
        f"1,000 agents (TP {TP}), {args.rate:g} rendezvous/s, "
        f"{args.seconds:g} s simulated after {args.warmup:g} s"
    )
    for key in ("ticks_per_s", "tick_cpu_us_per_s", "us_per_tick"):
        vals = [r[key] for r in runs]
        print(f"{key}: {statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
