"""``pushkv bench core``: the coordinator's own CPU per rendezvous, without the network.

Drives one Runtime in-process through the code the gRPC handlers run:
``TransferServicer.Submit`` (decode registrations, then prefill reports, in
batches of ``--batch`` calls) and ``Runtime.on_agent_message`` (one
``AgentBatch`` of POSTED + DONE reports on the prefill session, one of
arrivals on the decode session), with the engine pair, settings and
observers of ``pushkv bench coordinator`` (TP 1 by default, ``--tp`` ranks on
each side otherwise, one session per rank; 3 blocks per side). Request
messages are parsed from bytes and the coordinator's outgoing batches
serialized, as gRPC would, and timed as phases of their own. Building the
requests (the clients' work) is not timed.

Prints microseconds of thread CPU time per rendezvous by phase, median (and
range) over ``--reps`` repetitions of ``--n`` rendezvous each.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from pushkv.bench.coordinator_workload import (
    CORE_SETTINGS,
    DECODE,
    PREFILL,
    agent_hello,
    core_build,
    decode_request,
    prefill_request,
)
from pushkv.v1 import pushkv_pb2 as pb

PHASES = ("parse", "register", "prefill_done", "take", "serialize", "write", "arrival")
CORE_PHASES = ("register", "prefill_done", "take", "write", "arrival")


def _submit_bytes(tids: list[str], make: Callable[[str], pb.TransferCall]) -> bytes:
    return pb.SubmitRequest(calls=[make(t) for t in tids]).SerializeToString()


def _run(coro: Any) -> Any:
    """Run a coroutine that never awaits (Submit) to its result, with no loop."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("coroutine awaited")


async def _one_rep(
    n: int,
    batch: int,
    with_metrics: bool,
    rep: int,
    tp: int = 1,
    prefix: str = "",
    keep: list[Any] | None = None,
    settings: dict[str, Any] | None = None,
) -> dict[str, float]:
    """One repetition; `keep` gets the Runtime, whose transfers stay retained
    as `settings` (over CORE_SETTINGS) say."""
    from pushkv.controlplane import convert
    from pushkv.controlplane.auth import Authorizer
    from pushkv.controlplane.clock import SystemClock
    from pushkv.controlplane.logs import TransferLog
    from pushkv.controlplane.metrics import CoordinatorMetrics
    from pushkv.controlplane.runtime import AgentSession, Runtime
    from pushkv.controlplane.servicers import TransferServicer
    from pushkv.controlplane.settings import CoreSettings

    rt = Runtime(CoreSettings(**{**CORE_SETTINGS, **(settings or {})}), SystemClock())
    if with_metrics:
        rt.observers.append(CoordinatorMetrics(rt).events)
    rt.observers.append(TransferLog(rt.core.has_transfer))
    srv = TransferServicer(rt, Authorizer(tls_enabled=False))

    def sessions(engine: str, role: Any) -> list[AgentSession]:
        """One session per rank, as each rank's agent has."""
        return [
            rt.open_session(
                convert.registration_from_pb(
                    agent_hello(engine, role, batched=True, rank=r, tp=tp)
                ),
                accepts_batches=True,
            )
            for r in range(tp)
        ]

    sps = sessions(PREFILL, pb.ROLE_PREFILL)  # rank r writes into decode rank r
    sds = sessions(DECODE, pb.ROLE_DECODE)
    for s in (*sps, *sds):
        while not s.outbox.empty():
            s.outbox.get_nowait()  # the welcomes

    parse_submit: Callable[[bytes], pb.SubmitRequest] = pb.SubmitRequest.FromString
    parse_agent: Callable[[bytes], pb.AgentMessage] = pb.AgentMessage.FromString
    acc = dict.fromkeys(PHASES, 0)
    clock = time.thread_time_ns  # CPU time: a shared machine's preemptions do not count
    done = 0
    gc.collect()
    while done < n:
        k = min(batch, n - done)
        tids = [f"{prefix}r{rep}-{done + i}" for i in range(k)]
        done += k
        reg_bytes = _submit_bytes(tids, lambda t: pb.TransferCall(register=decode_request(t)))
        pre_bytes = _submit_bytes(tids, lambda t: pb.TransferCall(prefill_done=prefill_request(t)))

        t0 = clock()
        reg_req = parse_submit(reg_bytes)
        pre_req = parse_submit(pre_bytes)
        t1 = clock()
        r1 = _run(srv.Submit(reg_req, None))  # type: ignore[arg-type]
        r1.SerializeToString()
        t2 = clock()
        r2 = _run(srv.Submit(pre_req, None))  # type: ignore[arg-type]
        r2.SerializeToString()
        t3 = clock()
        outs: list[list[pb.CoordinatorMessage]] = []
        for sp in sps:
            out: list[pb.CoordinatorMessage] = []
            q = sp.outbox
            while not q.empty():
                first = q.get_nowait()
                assert first is not None
                msg, _ = sp.take(first)
                out.append(msg)
            outs.append(out)
        t4 = clock()
        for out in outs:
            for msg in out:
                msg.SerializeToString()
        t5 = clock()
        acc["parse"] += t1 - t0
        acc["register"] += t2 - t1
        acc["prefill_done"] += t3 - t2
        acc["take"] += t4 - t3
        acc["serialize"] += t5 - t4

        writes: list[bytes] = []
        arrivals: dict[int, list[pb.AgentMessage]] = {r: [] for r in range(tp)}
        for out in outs:
            orders = [
                m.order
                for msg in out
                for m in (msg.batch.messages if msg.WhichOneof("kind") == "batch" else (msg,))
                if m.WhichOneof("kind") == "order"
            ]
            assert len(orders) == k, (len(orders), k)
            writes.append(
                pb.AgentMessage(
                    batch=pb.AgentBatch(
                        messages=[
                            pb.AgentMessage(
                                write=pb.WriteReport(
                                    order_id=o.order_id, transfer_id=o.transfer_id, status=st
                                )
                            )
                            for o in orders
                            for st in (pb.WRITE_STATUS_POSTED, pb.WRITE_STATUS_DONE)
                        ]
                    )
                ).SerializeToString()
            )
            for o in orders:
                for t in o.targets:
                    arrivals[t.decode_rank].append(
                        pb.AgentMessage(
                            arrival=pb.ArrivalReport(
                                transfer_id=o.transfer_id, prefill_ranks=[o.prefill_rank]
                            )
                        )
                    )
        # A decode rank's arrivals as its agent batches them: one message per rank.
        arrival_bytes = [
            pb.AgentMessage(batch=pb.AgentBatch(messages=arrivals[r])).SerializeToString()
            for r in range(tp)
        ]
        t0 = clock()
        wmsgs = [parse_agent(b) for b in writes]
        amsgs = [parse_agent(b) for b in arrival_bytes]
        t1 = clock()
        for sp, wmsg in zip(sps, wmsgs, strict=True):
            rt.on_agent_message(sp, wmsg)
        t2 = clock()
        for sd, amsg in zip(sds, amsgs, strict=True):
            rt.on_agent_message(sd, amsg)
        t3 = clock()
        acc["parse"] += t1 - t0
        acc["write"] += t2 - t1
        acc["arrival"] += t3 - t2
    from pushkv.controlplane.domain import State

    wrong = sum(1 for t in rt.core.transfers() if t.state is not State.COMPLETE)
    if wrong:
        raise RuntimeError(f"{wrong} transfers not COMPLETE")
    for s in (*sps, *sds):
        rt.close_session(s)
    if keep is not None:
        keep.append(rt)
    return {p: ns / 1000 / n for p, ns in acc.items()}


def quiet_logs(level: str) -> None:
    from pushkv.controlplane import logs

    saved = sys.stderr
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (kept open: the logger writes here)
    try:
        logs.configure(level, json=True)
    finally:
        sys.stderr = saved


def run(
    n: int,
    batch: int,
    reps: int,
    with_metrics: bool,
    default_gc: bool = False,
    tp: int = 1,
) -> list[dict[str, float]]:
    from pushkv.controlplane.server import tune_gc

    if not default_gc:
        tune_gc()  # as `pushkv coordinator` does
    results = []
    for rep in range(reps):
        results.append(asyncio.run(_one_rep(n, batch, with_metrics, rep, tp)))
    return results


def _fmt(values: Sequence[float]) -> str:
    return f"{statistics.median(values):7.1f} ({min(values):6.1f}-{max(values):6.1f})"


def report(results: list[dict[str, float]], out: io.TextIOBase | Any = sys.stdout) -> float:
    """Print the table; returns the median core total."""
    for r in results:
        r["core"] = sum(r[p] for p in CORE_PHASES)
        r["total"] = sum(r[p] for p in PHASES)
    out.write("phase          us/rendezvous median (min-max)\n")
    for p in (*PHASES, "core", "total"):
        out.write(f"  {p:12s} {_fmt([r[p] for r in results])}\n")
    core = statistics.median(r["core"] for r in results)
    total = statistics.median(r["total"] for r in results)
    out.write(
        f"core_us_per_rendezvous={core:.1f} total_us_per_rendezvous={total:.1f} "
        f"rendezvous_per_core_s={1e6 / total:.0f}\n"
    )
    return core


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pushkv bench core", description=__doc__)
    p.add_argument("--n", type=int, default=20_000, help="rendezvous per repetition")
    p.add_argument("--batch", type=int, default=64, help="calls per Submit and reports per batch")
    p.add_argument("--reps", type=int, default=5, help="repetitions (median reported)")
    p.add_argument(
        "--tp", type=int, default=1, help="ranks on each side (one order per prefill rank)"
    )
    p.add_argument("--metrics", action="store_true", help="also run the Prometheus observer")
    p.add_argument(
        "--log-level", default="WARNING", help="coordinator log level (INFO: outcome lines)"
    )
    p.add_argument(
        "--default-gc", action="store_true", help="keep Python's GC thresholds (no tune_gc)"
    )
    p.add_argument("--profile", default="", help="write cProfile stats of one repetition here")
    p.add_argument(
        "--retained",
        type=int,
        default=0,
        help="instead: N rendezvous kept as terminal transfers, as the status API keeps "
        "them: GC-tracked objects each, RSS, and a full GC pass over them "
        "(pushkv/bench/coordinator_retained.py)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tp < 1:
        print("pushkv bench core: --tp must be at least 1", file=sys.stderr)
        return 2
    quiet_logs(args.log_level)
    if args.retained > 0:
        from pushkv.bench import coordinator_retained as retained

        print(core_build())
        print(
            f"{args.retained} rendezvous at TP {args.tp} kept as terminal transfers, "
            f"metrics={'on' if args.metrics else 'off'}, gc tuned"
        )
        retained.report(retained.run(args.retained, args.tp, args.batch, args.metrics))
        return 0
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        run(args.n, args.batch, 1, args.metrics, args.default_gc, args.tp)
        prof.disable()
        prof.dump_stats(args.profile)
        print(f"profile written to {args.profile}")
        return 0
    print(core_build())
    print(
        f"{args.reps} x {args.n} rendezvous at TP {args.tp}, batches of {args.batch}, "
        f"metrics={'on' if args.metrics else 'off'}, log level {args.log_level}, "
        f"gc {'default' if args.default_gc else 'tuned'}"
    )
    report(run(args.n, args.batch, args.reps, args.metrics, args.default_gc, args.tp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
