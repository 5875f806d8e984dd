"""`pushkv status`: where is transfer X, and why is it slow.

    pushkv status --coordinator HOST:PORT get TRANSFER_ID
    pushkv status --coordinator HOST:PORT ls [--state S...] [--engine E] [--limit N] [--sort WAIT]
    pushkv status --coordinator HOST:PORT watch [--state S...] [--engine E] [--existing] [--count N]
    pushkv status --coordinator HOST:PORT engines [--role prefill|decode]
    pushkv status --coordinator HOST:PORT[,HOST:PORT...] leader
    pushkv status --coordinator HOST:PORT[,HOST:PORT...]

With several coordinator replicas (comma-separated addresses), the commands
read from the one that leads; `leader` asks every replica for its view of the
election (its role, the leader and the leader's term). Without a command:
the overview, `leader`'s table, then the leader's engines and how many
transfers it has in flight.

Human tables by default; `--json` prints the StatusService responses as
protobuf JSON (one document per line for `watch`). `ls --sort` orders the
transfers the server returned (the newest `--limit`, server-side) by one of
the waits of controlplane/timeline.py, largest first: the request message has
no sort field, so sorting happens here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from pushkv.net.env import env_setting
from pushkv.net.leader import addresses
from pushkv.net.tls import TLSFiles
from pushkv.net.tls import channel as tls_channel
from pushkv.rules import timeline
from pushkv.rules.states import TERMINAL
from pushkv.tools import tables
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

DEFAULT_COORDINATOR = "127.0.0.1:50151"

# Short names accepted by --state; "active" and "terminal" expand to groups.
STATES: dict[str, list[pb.TransferState.ValueType]] = {
    pb.TransferState.Name(v).removeprefix("TRANSFER_STATE_").lower(): [v]
    for v in pb.TransferState.values()
    if v != pb.TRANSFER_STATE_UNSPECIFIED
}
STATES["terminal"] = sorted(TERMINAL)
STATES["active"] = [v for vs in STATES.values() for v in vs if v not in TERMINAL]
ROLES = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE}


def _env(name: str, default: str) -> str:
    value: str = env_setting(name, default)
    return value


def _state(text: str) -> str:
    key = text.lower().removeprefix("transfer_state_")
    if key not in STATES:
        raise argparse.ArgumentTypeError(f"unknown state {text!r}; known: {', '.join(STATES)}")
    return key


def _connection_flags(p: argparse.ArgumentParser, *, top: bool) -> None:
    """Shared flags; on subcommands they default to SUPPRESS so either position works."""

    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    g = p.add_argument_group("connection and output")
    g.add_argument(
        "--coordinator",
        default=default(_env("coordinator", DEFAULT_COORDINATOR)),
        help="coordinator HOST:PORT, or the replicas' addresses comma-separated",
    )
    g.add_argument(
        "--json",
        action="store_true",
        default=default(False),
        help="print protobuf JSON instead of tables",
    )
    g.add_argument(
        "--timeout-s",
        type=float,
        default=default(10.0),
        help="deadline of each RPC (not of watch)",
    )
    g.add_argument("--tls-ca", default=default(_env("tls_ca", "")), help="CA certificate (PEM)")
    g.add_argument(
        "--tls-cert",
        default=default(_env("tls_cert", "")),
        help="client certificate, CN operator:<name>",
    )
    g.add_argument("--tls-key", default=default(_env("tls_key", "")), help="client private key")


def register(sub: Any) -> Callable[[argparse.Namespace], int]:
    """Add the `status` subparser to the `pushkv` parser; return its handler."""
    p: argparse.ArgumentParser = sub.add_parser(
        "status",
        help="inspect transfers and engines on a running coordinator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _connection_flags(p, top=True)
    # No command: the overview (`_overview`).
    cmds = p.add_subparsers(dest="status_command", metavar="[COMMAND]")

    g = cmds.add_parser("get", help="one transfer: fields, waits, timeline and ranks")
    g.add_argument("transfer_id")
    _connection_flags(g, top=False)

    def filters(q: argparse.ArgumentParser) -> None:
        q.add_argument(
            "--state",
            type=_state,
            action="extend",
            nargs="+",
            default=[],
            metavar="STATE",
            help=f"only these states ({', '.join(STATES)}); repeatable",
        )
        q.add_argument("--engine", default="", help="only transfers of this engine (either side)")

    ls = cmds.add_parser("ls", help="list transfers, newest first, with their waits")
    filters(ls)
    ls.add_argument("--limit", type=int, default=100, help="at most this many (server max 10000)")
    ls.add_argument(
        "--sort",
        choices=timeline.WAITS,
        default="",
        help="sort the listed transfers by this wait, largest first (client-side)",
    )
    ls.add_argument("--asc", action="store_true", help="with --sort: smallest first")
    _connection_flags(ls, top=False)

    w = cmds.add_parser("watch", help="stream transfer changes until interrupted")
    filters(w)
    w.add_argument(
        "--existing",
        action="store_true",
        help="first replay matching live and retained terminal transfers",
    )
    w.add_argument("--count", type=int, default=0, help="stop after this many events (0 = never)")
    _connection_flags(w, top=False)

    e = cmds.add_parser("engines", help="engines, their ranks and lease health")
    e.add_argument("--role", choices=sorted(ROLES), default="", help="only this role")
    _connection_flags(e, top=False)

    ld = cmds.add_parser("leader", help="each replica's role, the leader and its term")
    _connection_flags(ld, top=False)

    return lambda args: run(args, sys.stdout)


def _states(names: Sequence[str]) -> list[pb.TransferState.ValueType]:
    out: list[pb.TransferState.ValueType] = []
    for n in names:
        out += [v for v in STATES[n] if v not in out]
    return out


def _json(msg: Message, *, compact: bool = False) -> str:
    return json_format.MessageToJson(msg, indent=None if compact else 2)


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Execute a parsed `pushkv status` command, writing to `out`."""
    tls = TLSFiles(args.tls_ca, args.tls_cert, args.tls_key)
    if tls.enabled or tls.key:
        tls.material()  # names a missing or mismatched file
    replicas = addresses(args.coordinator)
    if args.status_command == "leader":
        return _leader(replicas, tls, args, out)
    views = (
        [_leadership(a, tls, args.timeout_s) for a in replicas] if not args.status_command else []
    )
    if len(replicas) == 1:
        address = replicas[0]
    else:
        address = _find_leader(replicas, tls, args.timeout_s, views)
    with tls_channel(address, tls) as ch:
        stub = pbg.StatusServiceStub(ch)
        try:
            if not args.status_command:
                return _overview(stub, list(zip(replicas, views, strict=True)), args, out)
            return _COMMANDS[args.status_command](stub, args, out)
        except BrokenPipeError:  # `pushkv status watch | head`
            return 0
        except grpc.RpcError as exc:
            code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
            details = exc.details() if hasattr(exc, "details") else str(exc)
            what = args.status_command or "(overview)"
            sys.stderr.write(f"pushkv status {what}: {code}: {details}\n")
            return 1


ROLE_NAMES = {
    pb.LEADER_ROLE_SINGLE: "single",
    pb.LEADER_ROLE_LEADER: "leader",
    pb.LEADER_ROLE_STANDBY: "standby",
}


def _leadership(address: str, tls: TLSFiles, timeout_s: float) -> pb.Leadership | str:
    """The replica's Leadership, or why it could not be read."""
    with tls_channel(address, tls) as ch:
        try:
            view: pb.Leadership = pbg.StatusServiceStub(ch).GetLeadership(
                pb.GetLeadershipRequest(), timeout=timeout_s
            )
            return view
        except grpc.RpcError as exc:
            return exc.code().name if hasattr(exc, "code") else "UNKNOWN"


def _find_leader(
    replicas: Sequence[str],
    tls: TLSFiles,
    timeout_s: float,
    views: Sequence[pb.Leadership | str] = (),
) -> str:
    """The replica that leads, as the replicas say (the first one if none
    knows); `views`: the replicas' answers, if already asked."""
    for i, address in enumerate(replicas):
        view = views[i] if views else _leadership(address, tls, timeout_s)
        if isinstance(view, str):
            continue
        if view.role in (pb.LEADER_ROLE_LEADER, pb.LEADER_ROLE_SINGLE):
            return address
        if view.leader:
            return view.leader
    return replicas[0]


def _leadership_rows(
    views: Sequence[tuple[str, pb.Leadership | str]],
) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """`leader`'s table rows, and its JSON documents, one per replica."""
    rows: list[list[str]] = []
    docs: list[dict[str, Any]] = []
    for address, view in views:
        if isinstance(view, str):
            rows.append([address, f"unreachable ({view})", "", "", ""])
            docs.append({"replica": address, "error": view})
            continue
        docs.append(json_format.MessageToDict(view))
        rows.append(
            [
                address,
                ROLE_NAMES.get(view.role, "?"),
                view.leader or "-",
                str(view.term) if view.term else "-",
                view.etcd or "-",
            ]
        )
    return rows, docs


def _leader(replicas: Sequence[str], tls: TLSFiles, args: argparse.Namespace, out: TextIO) -> int:
    views = [(a, _leadership(a, tls, args.timeout_s)) for a in replicas]
    rows, docs = _leadership_rows(views)
    if args.json:
        out.write("\n".join(json.dumps(d) for d in docs) + "\n")
    else:
        out.write(tables.leadership_table(rows) + "\n")
    return 1 if all(isinstance(v, str) for _, v in views) else 0


def _overview(
    stub: pbg.StatusServiceStub,
    views: Sequence[tuple[str, pb.Leadership | str]],
    args: argparse.Namespace,
    out: TextIO,
) -> int:
    """`pushkv status` alone: each replica's view of the election, then the
    engines of the coordinator that leads and its transfers in flight."""
    engines = stub.ListEngines(pb.ListEnginesRequest(), timeout=args.timeout_s)
    live = stub.ListTransfers(
        pb.ListTransfersRequest(states=STATES["active"], limit=1), timeout=args.timeout_s
    ).total_matching
    rows, docs = _leadership_rows(views)
    if args.json:
        doc = {
            "replicas": docs,
            "engines": json_format.MessageToDict(engines).get("engines", []),
            "transfersInFlight": live,
        }
        out.write(json.dumps(doc, indent=2) + "\n")
        return 0
    out.write(tables.leadership_table(rows) + "\n\n")
    out.write(tables.engine_leases_table(engines.engines, int(time.time() * 1e6)) + "\n\n")
    out.write(f"transfers in flight: {live}\n")
    return 0


def _get(stub: pbg.StatusServiceStub, args: argparse.Namespace, out: TextIO) -> int:
    t = stub.GetTransfer(
        pb.GetTransferRequest(transfer_id=args.transfer_id), timeout=args.timeout_s
    )
    out.write((_json(t) if args.json else tables.transfer_detail(t)) + "\n")
    return 0


def _ls(stub: pbg.StatusServiceStub, args: argparse.Namespace, out: TextIO) -> int:
    if args.limit < 1:
        raise ValueError("--limit must be >= 1")
    req = pb.ListTransfersRequest(
        states=_states(args.state), engine_id=args.engine, limit=args.limit
    )
    resp = stub.ListTransfers(req, timeout=args.timeout_s)
    transfers = list(resp.transfers)
    if args.sort:
        transfers = timeline.sort_by_wait(transfers, args.sort, descending=not args.asc)
    if args.json:
        sorted_resp = pb.ListTransfersResponse(
            transfers=transfers, total_matching=resp.total_matching
        )
        out.write(_json(sorted_resp) + "\n")
        return 0
    out.write(tables.transfer_waits_table(transfers) + "\n")
    order = (
        f", sorted by {args.sort} ({'ascending' if args.asc else 'descending'})"
        if args.sort
        else ", newest first"
    )
    out.write(f"{len(transfers)} of {resp.total_matching} matching{order}\n")
    return 0


def _watch(stub: pbg.StatusServiceStub, args: argparse.Namespace, out: TextIO) -> int:
    req = pb.WatchTransfersRequest(
        states=_states(args.state), engine_id=args.engine, include_existing=args.existing
    )
    call = stub.WatchTransfers(req)
    seen = 0
    try:
        for event in call:
            t = event.transfer
            out.write((_json(event, compact=True) if args.json else tables.watch_line(t)) + "\n")
            out.flush()
            seen += 1
            if args.count and seen >= args.count:
                break
    finally:
        call.cancel()  # type: ignore[no-untyped-call]
    return 0


def _engines(stub: pbg.StatusServiceStub, args: argparse.Namespace, out: TextIO) -> int:
    req = pb.ListEnginesRequest(role=ROLES.get(args.role, pb.ROLE_UNSPECIFIED))
    resp = stub.ListEngines(req, timeout=args.timeout_s)
    if args.json:
        out.write(_json(resp) + "\n")
    else:
        out.write(tables.engine_leases_table(resp.engines, int(time.time() * 1e6)) + "\n")
    return 0


_COMMANDS: dict[str, Callable[[pbg.StatusServiceStub, argparse.Namespace, TextIO], int]] = {
    "get": _get,
    "ls": _ls,
    "watch": _watch,
    "engines": _engines,
}


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """`pushkv status ...` without the rest of the `pushkv` command (tests, scripts)."""
    parser = argparse.ArgumentParser(prog="pushkv")
    handler_sub = parser.add_subparsers(dest="command", required=True)
    register(handler_sub)
    args = parser.parse_args(["status", *(argv or [])])
    return run(args, out or sys.stdout)
