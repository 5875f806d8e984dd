"""Typed settings parsed once from `kv_connector_extra_config`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pushkv.agent.placement import check_setting as check_cpus
from pushkv.agent.starvation import check_dump_after
from pushkv.net.tls import TLSFiles
from pushkv.vllm_integration.logs import check_level

# on_transfer_failure values; each is also the vLLM kv_load_failure_policy it sets.
FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    # host:port of the pushkv coordinator (required).
    coordinator: str
    # Where this engine's worker agents dial instead of `coordinator`: the
    # node relay (`pushkv relay`, docs/operations.md), HOST:PORT on loopback or
    # unix:PATH. Empty: the agents dial `coordinator` themselves. The relay
    # holds the node's TLS identity; the agents reach it without TLS.
    agent_coordinator: str = ""
    # With `agent_coordinator` set: the scheduler's Submits go through that
    # relay too, on its one stream to the leader, instead of as RPCs of their
    # own (the relay's identity then authorizes them). False: they go to
    # `coordinator` directly, with `tls_*`.
    submit_through_relay: bool = True
    # This engine's OpenAI API base URL (http://HOST:PORT, as routers reach
    # it), published to routers via ListEngines. Required unless routable is
    # false (docs/configuration.md, "api_url").
    api_url: str = ""
    # Routers dispatch requests to this engine (a vLLM OpenAI server). False:
    # an engine no router uses (an offline LLM(), an in-process benchmark's
    # engine), which needs no api_url.
    routable: bool = True
    # How long worker start-up waits for the first registration with the coordinator.
    register_timeout_s: float = 60.0
    # Per-call deadline of the scheduler's coordinator RPCs.
    rpc_timeout_s: float = 5.0
    # On an engine step with nothing scheduled, the worker waits up to this long
    # for an agent event instead of letting the engine spin (0 disables).
    idle_wait_ms: float = 5.0
    # When the coordinator cannot be reached (a registration's outcome unknown,
    # or the agent's stream lost and not taken back), the decode side fails the
    # load (vLLM then recomputes) and the prefill side frees its blocks only
    # after this long: longer than the coordinator's write timeout plus an agent
    # lease, so no WRITE can land.
    uncertain_grace_s: float = 30.0
    # What a decode engine does when the push cannot complete (prefill leg
    # failed, prefill engine lost, coordinator unreachable, transfer failed or
    # expired): "recompute" computes the missing KV itself (the request
    # finishes correctly, later), "fail" ends the request with an error. Sets
    # vLLM's kv_transfer_config.kv_load_failure_policy on both engines, and the
    # router does the same with the requests it sends a decode engine (it
    # reads the engine's policy from the coordinator; docs/configuration.md,
    # "One failure policy").
    on_transfer_failure: str = "recompute"
    # Prefill: with chunked prefill (prompts longer than the step's token
    # budget) write each chunk's whole blocks of an armed order as soon as its
    # forward is done, not all at the end (docs/architecture.md, "Progressive
    # push"). One KV cache group only; false writes each request whole.
    progressive_push: bool = True
    # With several coordinator replicas: after a failover the agents re-send
    # their live transfers to the new leader (which adopts them) instead of
    # resolving them locally, and the scheduler half resubmits the sides the
    # old leader accepted, so transfers in flight at the failover complete
    # through the new leader (docs/reliability.md, "Failover rebuild" and
    # "Scheduler resubmission"). False: they fail (decode recomputes).
    rebuild_on_failover: bool = True
    # Mutual TLS to the coordinator (PEM paths); the certificate's common name
    # must be "engine:<engine_id>". All three or none.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # The level of pushkv's lines in the engine's log (DEBUG, INFO, WARNING,
    # ERROR); empty: vLLM's own (VLLM_LOGGING_LEVEL, INFO by default). Each
    # line names its logger, e.g. [pushkv.agent link.py:N]
    # (vllm_integration/logs.py). Unset under VLLM_CONFIGURE_LOGGING=0.
    log_level: str = ""
    # Diagnosing a stalled engine: > 0 (at most 86400) writes every Python
    # thread's stack of a worker to its stderr (the engine's log) when its
    # pushkv agent's watchdog thread has not run for this many seconds (a core
    # oversubscribed, or a C call holding the GIL; docs/operations.md, "A
    # starved agent"). The stall is logged either way; 0: no dump. One timer
    # per process (Python's faulthandler), so off by default.
    hang_dump_s: float = 0.0
    # The CPUs pushkv's threads run on in the engine's processes (the agent's,
    # gRPC's and UCX's in each worker, the scheduler's coordinator client):
    # "auto", on a CPU engine (vLLM-CPU), moves them off the compute cores
    # vLLM binds a worker's engine thread to, onto every CPU of those cores'
    # NUMA nodes that the engine was given (its cgroup, and a taskset or
    # numactl binding of the whole engine), and on a GPU engine leaves them be;
    # "inherit" leaves them on the engine thread's; a list such as "2-3,6"
    # puts them there (each CPU allowed by the cgroup). docs/operations.md,
    # "pushkv's threads and the compute cores"; agent/placement.py.
    thread_cpus: str = "auto"

    @property
    def tls(self) -> TLSFiles:
        return TLSFiles(self.tls_ca, self.tls_cert, self.tls_key)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if "metrics_port" in unknown:
            raise ValueError(
                "kv_connector_extra_config.metrics_port is gone: the connector's counters "
                "are on the engine's own /metrics now, every rank's (docs/operations.md, "
                "Metrics); remove the key and its ports"
            )
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown key(s) {unknown}; known: {sorted(known)}"
            )
        if not extra.get("coordinator"):
            raise ValueError("kv_connector_extra_config.coordinator (host:port) is required")
        values: dict[str, Any] = {}
        for name, raw in extra.items():
            f = known[name]
            try:
                if isinstance(f.default, bool):  # bool("false") is True
                    values[name] = _flag(raw)
                else:
                    values[name] = (
                        type(f.default)(raw) if f.default is not dataclasses.MISSING else str(raw)
                    )
            except (TypeError, ValueError):
                raise ValueError(f"kv_connector_extra_config.{name}: bad value {raw!r}") from None
        out = cls(**values)
        check_api_url(out.api_url, out.routable)
        if out.on_transfer_failure not in FAILURE_POLICIES:
            raise ValueError(
                "kv_connector_extra_config.on_transfer_failure: "
                f"{out.on_transfer_failure!r} is not one of {list(FAILURE_POLICIES)}"
            )
        try:
            check_dump_after(out.hang_dump_s)
        except ValueError as exc:
            raise ValueError(f"kv_connector_extra_config.hang_dump_s: {exc}") from None
        try:
            check_cpus(out.thread_cpus)
        except ValueError as exc:
            raise ValueError(f"kv_connector_extra_config.thread_cpus: {exc}") from None
        if out.log_level:
            try:
                out = dataclasses.replace(out, log_level=check_level(out.log_level))
            except ValueError as exc:
                raise ValueError(f"kv_connector_extra_config.{exc}") from None
        if out.tls.enabled or out.tls_key:
            out.tls.check()
        return out


def check_api_url(api_url: str, routable: bool) -> None:
    """A routable engine names where routers reach it: without api_url the
    engine would register, and every router would skip it (503 no_engine)."""
    if not api_url:
        if routable:
            raise ValueError(
                "kv_connector_extra_config.api_url is required: this engine's OpenAI API "
                "base URL as routers reach it (http://HOST:PORT of its vLLM server); "
                'an engine no router uses (offline, in-process) sets "routable": false'
            )
        return
    parts = urlsplit(api_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"kv_connector_extra_config.api_url: {api_url!r} is not an http:// or https:// "
            "URL with a host"
        )


def _flag(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)
