"""Human-readable tables of transfers and engines (demo and `pushkv status`)."""

from __future__ import annotations

from collections.abc import Sequence

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


def _wait_ms(t: pb.TransferStatus, start: str, end: str) -> str:
    times = {e.stage: e.unix_us for e in t.timeline if e.rank == -1}
    if start in times and end in times:
        return f"{(times[end] - times[start]) / 1000:.1f}"
    return "-"


def transfers_table(transfers: Sequence[pb.TransferStatus]) -> str:
    rows = []
    for t in transfers:
        ranks = ",".join(
            f"{r.prefill_rank}:{pb.RankState.Name(r.state).removeprefix('RANK_STATE_').lower()}"
            + ("+arrived" if r.arrived else "")
            for r in t.ranks
        )
        first = min((e.unix_us for e in t.timeline), default=0)
        ordered = next((e.unix_us for e in t.timeline if e.stage == "ordered"), 0)
        end = t.updated_unix_us
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
                f"{(ordered - first) / 1000:.1f}" if ordered else "-",
                f"{(end - ordered) / 1000:.1f}"
                if ordered and t.state >= pb.TRANSFER_STATE_COMPLETE
                else "-",
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
            "RDV_MS",
            "WRITE_MS",
        ],
        rows,
    )


def engines_table(engines: Sequence[pb.EngineStatus]) -> str:
    rows = []
    for e in engines:
        for r in e.ranks:
            rows.append(
                [
                    e.engine_id,
                    pb.Role.Name(e.role).removeprefix("ROLE_").lower(),
                    f"{r.tp_rank}/{e.tp_size}",
                    r.incarnation,
                    "yes" if r.connected else "no",
                    "yes" if e.ready else "no",
                    str(r.inflight_orders),
                    str(e.inflight_transfers),
                ]
            )
    return _table(
        ["ENGINE", "ROLE", "RANK", "INCARNATION", "CONNECTED", "READY", "OPEN_ORDERS", "INFLIGHT"],
        rows,
    )
