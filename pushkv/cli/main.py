"""The `pushkv` command. Subcommands only fill settings and call into the packages."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from pushkv.controlplane.settings import CoreSettings
from pushkv.net.env import EnvSettingError, env_setting, parse_bool

# The servers' event loops: uvloop (libuv's; vLLM depends on it too) costs a
# gRPC server here about a sixth less CPU per unary call than asyncio's own
# (`pushkv bench transport`), which stays selectable.
EVENT_LOOPS = ("uvloop", "asyncio")
T = TypeVar("T")


def _hang_dump_s(text: str) -> float:
    from pushkv.net.event_loop import check_dump_after

    try:
        return check_dump_after(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cell(text: str) -> str:
    from pushkv.controlplane.leadership import election_key

    try:
        election_key(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


class _Removed(argparse.Action):
    """A flag that no longer exists, refused with what replaced it."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kw: Any) -> None:
        parser.error(
            "--on-transfer-failure is gone: the router follows each decode engine's "
            "on_transfer_failure (its kv_connector_extra_config; docs/configuration.md)"
        )


def _env(name: str, default: Any, choices: Sequence[str] | None = None) -> Any:
    return env_setting(name, default, choices=choices)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pushkv")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown (not installed)"


def _run(main: Coroutine[Any, Any, T], event_loop: str) -> T:
    """A server's main coroutine on the event loop chosen by --event-loop."""
    if event_loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def _add_event_loop_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default=_env("event_loop", EVENT_LOOPS[0], EVENT_LOOPS),
        help="the process's asyncio event loop: uvloop (default: about a sixth less CPU "
        "per unary gRPC call, docs/operations.md) or asyncio's own",
    )


def _add_core_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rendezvous settings (flag, or env PUSHKV_<NAME>)")
    for f in dataclasses.fields(CoreSettings):
        default = _env(f.name, f.default)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            g.add_argument(
                flag,
                type=parse_bool,
                default=default,
                metavar="BOOL",
                help=f"default {f.default}",
            )
        else:
            g.add_argument(flag, type=type(f.default), default=default, help=f"default {f.default}")


def _add_tls_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mutual TLS (all three, or none for insecure dev mode)")
    g.add_argument("--tls-ca", default=_env("tls_ca", ""), help="CA certificate (PEM)")
    g.add_argument("--tls-cert", default=_env("tls_cert", ""), help="this side's certificate")
    g.add_argument("--tls-key", default=_env("tls_key", ""), help="this side's private key")


def _etcd_tls(args: argparse.Namespace) -> Any:
    from pushkv.net.tls import TLSFiles

    return TLSFiles(args.etcd_ca, args.etcd_cert, args.etcd_key)


def _tls(args: argparse.Namespace) -> Any:
    from pushkv.net.tls import TLSFiles

    files = TLSFiles(args.tls_ca, args.tls_cert, args.tls_key)
    if files.enabled or files.key:
        files.check()
    return files


def _core_settings(args: argparse.Namespace) -> CoreSettings:
    return CoreSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(CoreSettings)})


def _cmd_coordinator(args: argparse.Namespace) -> int:
    from pushkv.controlplane import logs
    from pushkv.controlplane.server import ServerSettings, serve

    logs.configure(args.log_level)
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        max_message_bytes=args.max_message_bytes,
        shutdown_grace_s=args.shutdown_grace_s,
        port_file=args.port_file,
        metrics_port=args.metrics_port or None,
        rank_metrics=args.rank_metrics,
        tls=_tls(args),
        core=_core_settings(args),
        etcd=args.etcd,
        cell=args.cell,
        advertise=args.advertise,
        etcd_lease_s=args.etcd_lease_s,
        etcd_tls=_etcd_tls(args),
        etcd_user=args.etcd_user,
        etcd_password_file=args.etcd_password_file,
        loop_stall_limit_s=args.loop_stall_limit_s,
        hang_dump_s=args.hang_dump_s,
    )
    return _run(serve(settings), args.event_loop)


# The router's --on-transfer-failure is gone: the router follows each decode
# engine's on_transfer_failure (docs/configuration.md, "One failure policy").
# A deployment still setting it is told so, not silently ignored.
_ROUTER_POLICY_VAR = "PUSHKV_ON_TRANSFER_FAILURE"


def _cmd_router(args: argparse.Namespace) -> int:
    import os

    from pushkv.net import logs
    from pushkv.router.app import RouterSettings, serve

    if os.environ.get(_ROUTER_POLICY_VAR):
        raise ValueError(
            f"{_ROUTER_POLICY_VAR} is no longer read: the router follows each decode engine's "
            "on_transfer_failure (kv_connector_extra_config); unset it"
        )
    logs.configure(args.log_level)
    settings = RouterSettings(
        coordinator=args.coordinator,
        host=args.host,
        port=args.port,
        leg_timeout_s=args.leg_timeout_s,
        pool_idle_s=args.pool_idle_s,
        unlisted_grace_s=args.unlisted_grace_s,
        first_token=args.first_token,
        tls=_tls(args),
    )
    asyncio.run(serve(settings))
    return 0


def _cmd_relay(args: argparse.Namespace) -> int:
    from pushkv.net import logs
    from pushkv.relay.server import RelaySettings, serve

    logs.configure(args.log_level)
    settings = RelaySettings(
        coordinators=args.coordinator,
        listen=args.listen,
        tls=_tls(args),
        port_file=args.port_file,
        max_message_bytes=args.max_message_bytes,
    )
    return _run(serve(settings), args.event_loop)


def _cmd_dev_certs(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pushkv.tools.devpki import make_pki

    paths = make_pki(
        Path(args.out_dir),
        engines=args.engine,
        operators=args.operator or ["ops"],
        hosts=args.host or ["localhost", "127.0.0.1"],
        ca_from=Path(args.ca_from) if args.ca_from else None,
    )
    for cn, path in paths.items():
        sys.stdout.write(f"{cn:24s} {path} (+ .key)\n")
    sys.stdout.write(f"{'CA':24s} {Path(args.out_dir) / 'ca.pem'}\n")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.which == "dataplane":
        from pushkv.bench.dataplane import main as bench_dataplane

        return bench_dataplane(args.rest)
    if args.which == "order":
        from pushkv.bench.order import main as bench_order

        return bench_order(args.rest)
    if args.which == "serving":
        from pushkv.bench.serving.main import main as bench_serving

        return bench_serving(args.rest)
    if args.which == "core":
        from pushkv.bench.coordinator_core import main as bench_core

        return bench_core(args.rest)
    if args.which == "hooks":
        from pushkv.bench.hooks.main import main as bench_hooks

        return bench_hooks(args.rest)
    if args.which == "link":
        from pushkv.bench.link import main as bench_link

        return bench_link(args.rest)
    if args.which == "failover":
        from pushkv.bench.failover import main as bench_failover

        return bench_failover(args.rest)
    if args.which == "cluster":
        from pushkv.bench.cluster import main as bench_cluster

        return bench_cluster(args.rest)
    if args.which == "transport":
        from pushkv.bench.transport import main as bench_transport

        return bench_transport(args.rest)
    from pushkv.bench.coordinator import main as bench_coordinator

    return bench_coordinator(args.rest)


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.dataplane:
        from pushkv.demo.dataplane import run

        return run(transfers=args.transfers)
    from pushkv.demo.serving import run as run_vllm

    return run_vllm(requests=args.requests)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[..., int]]]:
    parser = argparse.ArgumentParser(prog="pushkv", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pushkv {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    handlers: dict[str, Callable[..., int]] = {}

    c = sub.add_parser("coordinator", help="run the rendezvous coordinator (gRPC)")
    c.add_argument("--host", default=_env("host", "127.0.0.1"))
    c.add_argument("--port", type=int, default=_env("port", 50151))
    c.add_argument("--max-message-bytes", type=int, default=_env("max_message_bytes", 4 << 20))
    c.add_argument("--shutdown-grace-s", type=float, default=_env("shutdown_grace_s", 5.0))
    c.add_argument("--port-file", default="", help="write the bound port here (with --port 0)")
    c.add_argument(
        "--metrics-port",
        type=int,
        default=_env("metrics_port", 0),
        help="serve Prometheus /metrics over HTTP on --host at this port (0 = off)",
    )
    c.add_argument(
        "--rank-metrics",
        type=parse_bool,
        default=_env("rank_metrics", True),
        metavar="BOOL",
        help="with --metrics-port: also the three pushkv_agent_* series of every rank, "
        "besides the per-engine ones (false for large clusters: a scrape of 1,000 ranks "
        "took about 56 ms of the coordinator with them, 24 without; default true)",
    )
    c.add_argument("--log-level", default=_env("log_level", "INFO"))
    c.add_argument(
        "--hang-dump-s",
        type=_hang_dump_s,
        default=_env("hang_dump_s", 0.0),
        help="diagnostics: an event loop that did not run for this many seconds has every "
        "thread's stack written to stderr, to name what held it (a blocking call, a C call "
        "holding the GIL); each second the loop pushes faulthandler's timer back (a short "
        "C thread each time). 0 = off (default)",
    )
    _add_event_loop_flag(c)
    h = c.add_argument_group("replicated coordinators (docs/reliability.md)")
    h.add_argument(
        "--etcd",
        default=_env("etcd", ""),
        help="etcd client URLs (http://HOST:PORT, comma-separated): run as a replica that "
        "campaigns for leadership there; empty = the single in-memory coordinator",
    )
    h.add_argument(
        "--cell",
        type=_cell,
        default=_env("cell", ""),
        help="with --etcd: the coordinator cell this replica belongs to (a DNS label): its "
        "replicas campaign on /pushkv/cells/CELL/leader, so several cells share one etcd, "
        "each with its own leader and engines (docs/operations.md, 'Coordinator cells'); "
        "default none: /pushkv/coordinator/leader",
    )
    h.add_argument(
        "--advertise",
        default=_env("advertise", ""),
        help="HOST:PORT clients dial for this replica (standbys name the leader by it); "
        "default --host:bound port",
    )
    h.add_argument(
        "--etcd-lease-s",
        type=int,
        default=_env("etcd_lease_s", 2),
        help="TTL of the replica's etcd lease in whole seconds: a dead leader is replaced "
        "about this long after it stopped renewing (etcd may grant more: its minimum is "
        "1.5 election timeouts)",
    )
    h.add_argument(
        "--loop-stall-limit-s",
        type=float,
        default=_env("loop_stall_limit_s", 5.0),
        help="a leader renews its etcd lease from a thread while its event loop has run "
        "within this many seconds; a loop stalled longer lets the lease expire and a "
        "standby leads",
    )
    h.add_argument(
        "--etcd-ca",
        default=_env("etcd_ca", ""),
        help="with https:// etcd endpoints: the CA certificate (PEM) that signs etcd's",
    )
    h.add_argument(
        "--etcd-cert",
        default=_env("etcd_cert", ""),
        help="this replica's client certificate for etcd (PEM), where etcd requires one "
        "(--client-cert-auth)",
    )
    h.add_argument("--etcd-key", default=_env("etcd_key", ""), help="its private key (PEM)")
    h.add_argument(
        "--etcd-user",
        default=_env("etcd_user", ""),
        help="where etcd's authentication is on: the etcd user this replica acts as "
        "(it needs read and write on the election key: /pushkv/coordinator/leader, or "
        "/pushkv/cells/CELL/leader with --cell)",
    )
    h.add_argument(
        "--etcd-password-file",
        default=_env("etcd_password_file", ""),
        help="a file holding that user's password (a mounted secret; one trailing "
        "newline is ignored)",
    )
    _add_tls_flags(c)
    _add_core_flags(c)
    handlers["coordinator"] = _cmd_coordinator

    d = sub.add_parser("demo", help="run the local 1P1D demo on embedded defaults")
    d.add_argument("--requests", type=int, default=12, help="concurrent requests (1P1D demo)")
    d.add_argument(
        "--dataplane", action="store_true", help="run the data-plane-only demo (KV hosts, no vLLM)"
    )
    d.add_argument("--transfers", type=int, default=8, help="transfers per arrival order")
    d.add_argument("--log-level", default="WARNING")
    handlers["demo"] = _cmd_demo

    r = sub.add_parser("router", help="run the OpenAI-compatible concurrent-dispatch router")
    r.add_argument("--coordinator", default=_env("coordinator", "127.0.0.1:50151"))
    r.add_argument("--host", default=_env("router_host", "127.0.0.1"))
    r.add_argument("--port", type=int, default=_env("router_port", 8000))
    r.add_argument("--leg-timeout-s", type=float, default=_env("leg_timeout_s", 600.0))
    r.add_argument(
        "--on-transfer-failure",
        action=_Removed,
        nargs="?",
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    r.add_argument(
        "--pool-idle-s",
        type=float,
        default=_env("pool_idle_s", 2.0),
        help="close pooled engine connections idle this long; keep below the engines' "
        "keep-alive (vLLM: 5 s)",
    )
    r.add_argument(
        "--unlisted-grace-s",
        type=float,
        default=_env("unlisted_grace_s", 10.0),
        help="a decode engine that drops out of the coordinator's list (a restarted "
        "coordinator lists none until the agents reconnect) still serves requests alone "
        "this long",
    )
    r.add_argument(
        "--first-token",
        choices=("prefill", "decode"),
        default=_env("first_token", "decode", choices=("prefill", "decode")),
        help="decode: both legs leave at once and the decode engine answers every token "
        "(its blocks registered while the prefill computes); prefill: the client's first "
        "token is the prefill's, sent at once, and the decode engine continues from "
        "token 2 (its blocks allocated when the prefill answers; docs/architecture.md, "
        "'The first token')",
    )
    r.add_argument("--log-level", default=_env("log_level", "INFO"))
    _add_tls_flags(r)
    handlers["router"] = _cmd_router

    y = sub.add_parser(
        "relay",
        help="run a node relay: the node's agents dial it, and it carries their streams "
        "to the leading coordinator on one stream",
    )
    y.add_argument(
        "--coordinator",
        default=_env("coordinator", "127.0.0.1:50151"),
        help="coordinator replicas, comma-separated (the relay follows the leader)",
    )
    y.add_argument(
        "--listen",
        default=_env("relay_listen", "127.0.0.1:50161"),
        help="where the node's agents dial: HOST:PORT on loopback, or unix:PATH",
    )
    y.add_argument(
        "--max-message-bytes",
        type=int,
        default=_env("max_message_bytes", 4 << 20),
        help="the coordinator's --max-message-bytes: the largest message carried",
    )
    y.add_argument("--port-file", default="", help="write the bound port here (with port 0)")
    y.add_argument("--log-level", default=_env("log_level", "INFO"))
    _add_event_loop_flag(y)
    _add_tls_flags(y)
    handlers["relay"] = _cmd_relay

    k = sub.add_parser("dev-certs", help="write a throw-away CA and mTLS certificates")
    k.add_argument("out_dir")
    k.add_argument("--engine", action="append", default=[], help="engine id (repeatable)")
    k.add_argument("--operator", action="append", default=[], help="operator name (repeatable)")
    k.add_argument("--host", action="append", default=[], help="server host/IP (repeatable)")
    k.add_argument(
        "--ca-from",
        default="",
        help="issue the certificates from the CA in this folder (a renewal: new keys, same CA)",
    )
    handlers["dev-certs"] = _cmd_dev_certs

    b = sub.add_parser("bench", help="benchmarks (commands that print figures)")
    b.add_argument(
        "which",
        choices=[
            "dataplane",
            "coordinator",
            "core",
            "order",
            "serving",
            "hooks",
            "link",
            "failover",
            "cluster",
            "transport",
        ],
    )
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    handlers["bench"] = _cmd_bench

    for name, register in _EXTRA_COMMANDS:
        handlers[name] = register(sub)
    return parser, handlers


# Later subcommands (router, status, bench, ...) register here: (name, add_parser fn).
def _register_status(sub: Any) -> Callable[..., int]:
    from pushkv.tools.status import register

    return register(sub)


_EXTRA_COMMANDS: list[tuple[str, Callable[[Any], Callable[..., int]]]] = [
    ("status", _register_status),
]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser, handlers = build_parser()
    except EnvSettingError as exc:
        # Before any subcommand parses: a bad PUSHKV_* value is a usage error.
        sys.stderr.write(f"pushkv: error: {exc}\n")
        return 2
    args = parser.parse_args(argv)
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"pushkv {args.command}: {exc}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
