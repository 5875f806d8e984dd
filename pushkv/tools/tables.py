"""Human-readable tables of transfers and engines (demo and `pushkv status`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from pushkv.rules import timeline
from pushkv.v1 import pushkv_pb2 as pb


def _state(value: pb.TransferState.ValueType) -> str:
    return pb.TransferState.Name(value).removeprefix("TRANSFER_STATE_").lower()


def _reason(value: pb.Reason.ValueType) -> str:
    return pb.Reason.Name(value).removeprefix("REASON_").lower() if value else ""


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def transfers_table(transfers: Sequence[pb.TransferStatus]) -> str:
    """One row per transfer: its state, engines, blocks, ranks, and two of the
    waits of controlplane/timeline.py (an armed order is timed from its first
    post, as there)."""
    rows = []
    for t in transfers:
        w = timeline.waits(t)
        ranks = ",".join(
            f"{r.prefill_rank}:{pb.RankState.Name(r.state).removeprefix('RANK_STATE_').lower()}"
            + ("+arrived" if r.arrived else "")
            for r in t.ranks
        )
        rows.append(
            [
                t.transfer_id,
                _state(t.state),
                _reason(t.reason),
                t.prefill_engine_id or "-",
                t.decode_engine_id or "-",
                str(sum(len(g.ids) for g in t.decode_blocks)),
                ranks or "-",
                ",".join(map(str, t.outstanding_ranks)) or "-",
                _ms(w.rendezvous_wait),
                _ms(w.write_time),
            ]
        )
    return _table(
        [
            "TRANSFER",
            "STATE",
            "REASON",
            "PREFILL",
            "DECODE",
            "BLOCKS",
            "RANKS",
            "OUTSTANDING",
            "RDV_WAIT_MS",
            "WRITE_MS",
        ],
        rows,
    )


def rank_text(e: pb.EngineStatus, r: pb.RankLease) -> str:
    """ "1/2": TP rank 1 of 2; with pipeline parallelism "pp1/2.tp0/2": stage 1
    of 2, TP rank 0 of 2 in it (RankLease.tp_rank is then the engine's rank
    number, pp_rank * tp_size + TP rank)."""
    if e.pp_size <= 1:
        return f"{r.tp_rank}/{e.tp_size}"
    return f"pp{r.pp_rank}/{e.pp_size}.tp{r.tp_rank % max(1, e.tp_size)}/{e.tp_size}"


def _connected(r: pb.RankLease) -> str:
    """yes; no; or grace: not connected, within its reconnect grace."""
    return "yes" if r.connected else "grace" if r.returning else "no"


def engines_table(engines: Sequence[pb.EngineStatus]) -> str:
    rows = []
    for e in engines:
        for r in e.ranks:
            rows.append(
                [
                    e.engine_id,
                    pb.Role.Name(e.role).removeprefix("ROLE_").lower(),
                    rank_text(e, r),
                    r.incarnation,
                    _connected(r),
                    "yes" if e.ready else "no",
                    str(r.inflight_orders),
                    str(e.inflight_transfers),
                ]
            )
    return _table(
        ["ENGINE", "ROLE", "RANK", "INCARNATION", "CONNECTED", "READY", "OPEN_ORDERS", "INFLIGHT"],
        rows,
    )


# ------------------------------------------------------------------ `pushkv status`


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _when(unix_us: int, *, date: bool = False) -> str:
    if not unix_us:
        return "-"
    at = datetime.fromtimestamp(unix_us / 1e6, tz=UTC)
    text = at.strftime("%Y-%m-%dT%H:%M:%S.%f" if date else "%H:%M:%S.%f")[:-3]
    return text + ("Z" if date else "")


def _rank_state(value: pb.RankState.ValueType) -> str:
    return pb.RankState.Name(value).removeprefix("RANK_STATE_").lower()


def transfer_waits_table(transfers: Sequence[pb.TransferStatus]) -> str:
    """One row per transfer with every wait of controlplane/timeline.py, in ms."""
    rows = []
    for t in transfers:
        w = timeline.waits(t)
        rows.append(
            [
                t.transfer_id,
                _state(t.state),
                _reason(t.reason) or "-",
                t.prefill_engine_id or "-",
                t.decode_engine_id or "-",
                _when(t.created_unix_us),
                *(_ms(w.get(name)) for name in timeline.WAITS),
            ]
        )
    return _table(
        [
            "TRANSFER",
            "STATE",
            "REASON",
            "PREFILL",
            "DECODE",
            "CREATED",
            "RDV_WAIT_MS",
            "ORDER_MS",
            "WRITE_MS",
            "ARRIVAL_LAG_MS",
            "TOTAL_MS",
        ],
        rows,
    )


_WAIT_NOTES = {
    "rendezvous_wait": "prefill_done - decode_registered (>0: decode registered first)",
    "order_latency": "second arrival -> ordered",
    "write_time": "ordered -> last write_done",
    "arrival_lag": "last arrived - last write_done",
    "total": "created -> terminal state",
}


def transfer_detail(t: pb.TransferStatus) -> str:
    """Everything about one transfer: fields, waits, timeline and ranks."""
    blocks = ", ".join(
        f"{side} {sum(len(g.ids) for g in groups)}"
        for side, groups in (("decode", t.decode_blocks), ("prefill", t.prefill_blocks))
        if groups
    )
    fields = [
        ("transfer", t.transfer_id),
        ("state", _state(t.state)),
        ("reason", _reason(t.reason) or "-"),
        ("detail", t.detail or "-"),
        ("prefill", t.prefill_engine_id or "-"),
        ("decode", t.decode_engine_id or "-"),
        ("tokens", str(t.num_tokens)),
        ("blocks", blocks or "-"),
        ("outstanding", ",".join(map(str, t.outstanding_ranks)) or "-"),
        ("write may land", "yes" if t.write_may_land else "no"),
        ("created", _when(t.created_unix_us, date=True)),
        ("updated", _when(t.updated_unix_us, date=True)),
        ("deadline", _when(t.deadline_unix_us, date=True)),
    ]
    width = max(len(k) for k, _ in fields)
    out = [f"{k.ljust(width)}  {v}" for k, v in fields]
    w = timeline.waits(t)
    out += [
        "",
        _table(
            ["WAIT", "MS", "MEANING"],
            [[n, _ms(w.get(n)), _WAIT_NOTES[n]] for n in timeline.WAITS],
        ),
    ]
    start = t.created_unix_us
    out += [
        "",
        _table(
            ["STAGE", "RANK", "AT", "+MS"],
            [
                [
                    e.stage,
                    str(e.rank) if e.rank >= 0 else "-",
                    _when(e.unix_us),
                    f"{(e.unix_us - start) / 1000:.1f}",
                ]
                for e in t.timeline
            ],
        ),
    ]
    if t.ranks:
        stages = timeline.per_rank(timeline.events_of(t))
        ev = timeline.events_of(t)
        # An armed order's times count from its arming (docs/architecture.md).
        ordered = timeline.first(ev, "ordered") or timeline.first(ev, "armed")

        def since_order(rank: int, stage: str) -> str:
            at = stages.get(rank, {}).get(stage)
            return _ms(at - ordered) if at is not None and ordered is not None else "-"

        out += [
            "",
            _table(
                [
                    "RANK",
                    "ORDER",
                    "STATE",
                    "ARRIVED",
                    "POSTS",
                    "POSTED_MS",
                    "DONE_MS",
                    "ARRIVED_MS",
                    "DETAIL",
                ],
                [
                    [
                        str(r.prefill_rank),
                        r.order_id,
                        _rank_state(r.state),
                        "yes" if r.arrived else "no",
                        str(r.posts) if r.posts else "-",
                        since_order(r.prefill_rank, "write_posted"),
                        since_order(r.prefill_rank, "write_done"),
                        since_order(r.prefill_rank, "arrived"),
                        r.detail or "-",
                    ]
                    for r in t.ranks
                ],
            ),
        ]
    return "\n".join(out)


def engine_leases_table(engines: Sequence[pb.EngineStatus], now_us: int) -> str:
    """engines_table plus lease health, seen from a client clock (`now_us`)."""
    rows = []
    for e in engines:
        for r in e.ranks:
            rows.append(
                [
                    e.engine_id,
                    pb.Role.Name(e.role).removeprefix("ROLE_").lower(),
                    rank_text(e, r),
                    r.incarnation,
                    _connected(r),
                    "yes" if e.ready else "no",
                    f"{(now_us - r.last_seen_unix_us) / 1e6:.1f}",
                    f"{(r.lease_expires_unix_us - now_us) / 1e6:.1f}",
                    str(r.inflight_orders),
                    str(e.inflight_transfers),
                    e.api_url or "-",
                    r.relay or "-",
                ]
            )
    return _table(
        [
            "ENGINE",
            "ROLE",
            "RANK",
            "INCARNATION",
            "CONNECTED",
            "READY",
            "SEEN_S_AGO",
            "LEASE_LEFT_S",
            "OPEN_ORDERS",
            "INFLIGHT",
            "API_URL",
            "RELAY",
        ],
        rows,
    )


def watch_line(t: pb.TransferStatus) -> str:
    """One line per WatchTransfers event: time, transfer, state and its latest stage."""
    latest = t.timeline[-1] if t.timeline else None
    stage = "-"
    if latest is not None:
        stage = latest.stage + (f"[{latest.rank}]" if latest.rank >= 0 else "")
    extra = f"  {t.detail}" if t.detail else ""
    return (
        f"{_when(t.updated_unix_us)}  {t.transfer_id}  {_state(t.state):<12}  "
        f"{_reason(t.reason) or '-':<16}  {stage}{extra}"
    )


def leadership_table(rows: Sequence[Sequence[str]]) -> str:
    """`pushkv status leader`: one row per coordinator replica."""
    return _table(["REPLICA", "ROLE", "LEADER", "TERM", "ETCD"], rows)
