"""The router's view of the engines: what the coordinator lists (ListEngines),
and the (prefill, decode) pairs among them that the coordinator would accept
(pushkv/rules/pairing.py: the rule it applies where the two sides meet)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc
import structlog

from pushkv.rules.pairing import KVShape, pair_mismatch
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

log = structlog.get_logger("pushkv.router")


@dataclass(slots=True)
class Engine:
    engine_id: str
    url: str
    inflight: int = 0  # as last reported by the coordinator
    local: int = 0  # requests this router has open on it
    tp_size: int = 1
    shape: KVShape = field(default_factory=lambda: KVShape(0))
    # The engine's on_transfer_failure (EngineStatus): as a decode engine,
    # whether the router serves its requests alone when the push cannot
    # happen (recompute; unstated reads so), or answers 502/503 at once (fail).
    recompute: bool = True

    @property
    def load(self) -> int:
        return self.inflight + self.local


def shape_of(e: pb.EngineStatus) -> KVShape:
    """The pairing rule's view of a listed engine (EngineStatus.kv)."""
    return KVShape(
        e.tokens_per_block,
        compat=tuple(sorted(e.kv.compat.items())),
        compat_hash=e.kv.compat_hash,
        kv_heads=e.kv.kv_heads,
        head_major=e.kv.head_major,
        regions=tuple([(r.group, r.block_len) for r in e.kv.regions]),
        layers=tuple([r.layer if r.HasField("layer") else -1 for r in e.kv.regions]),
        pp_size=max(1, e.kv.pp_size),
    )


def unused_because(e: pb.EngineStatus) -> tuple[str, str]:
    """Why the router cannot send this listed engine requests: (reason, detail),
    or ("", "") when it can."""
    if e.role not in (pb.ROLE_PREFILL, pb.ROLE_DECODE):
        return "bad_role", f"role {e.role} is neither prefill nor decode"
    if not e.api_url:
        return "no_api_url", (
            "it registered without an api_url (a data-plane-only agent); a vLLM engine "
            "sets api_url in its kv_connector_extra_config"
        )
    if not e.ready:
        return "not_ready", "not every rank is registered and connected"
    return "", ""


@dataclass
class EngineDirectory:
    """Engines known to the coordinator, refreshed in the background, and the
    (prefill, decode) pairs among them that the coordinator would accept
    (pushkv/rules/pairing.py: the rule it applies when the two sides meet)."""

    stub: pbg.StatusServiceAsyncStub
    # A decode engine that drops out of the list stays usable this long, for the
    # decode engine alone: a restarted coordinator lists no engine until the
    # agents' reconnects reach it (a few seconds), and the engines still serve.
    unlisted_grace_s: float = 10.0
    prefill: dict[str, Engine] = field(default_factory=dict)
    decode: dict[str, Engine] = field(default_factory=dict)
    pairs: list[tuple[Engine, Engine]] = field(default_factory=list)
    # Why no pair exists, while prefill and decode engines both do ("" otherwise).
    unpaired: str = ""
    error: str = "engine list not loaded yet"
    # Decode engines no longer listed, each with the monotonic time it expires.
    unlisted: dict[str, tuple[Engine, float]] = field(default_factory=dict)
    _rr: itertools.count[int] = field(default_factory=itertools.count)
    # Listed engines the router does not use, each with why ("reason: detail");
    # each is logged once, not on every refresh (again after it was usable).
    unused: dict[str, str] = field(default_factory=dict)
    _refused: set[str] = field(default_factory=set)  # pairs refused, as logged

    async def refresh(self) -> None:
        try:
            resp = await self.stub.ListEngines(pb.ListEnginesRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            self.error = f"coordinator unreachable: {exc.code().name}"
            return
        self.update(resp.engines)

    def update(self, engines: Iterable[pb.EngineStatus]) -> None:
        """Take the engines ListEngines answered; pair them."""
        seen: dict[int, dict[str, Engine]] = {pb.ROLE_PREFILL: {}, pb.ROLE_DECODE: {}}
        unused: dict[str, str] = {}
        for e in engines:
            reason, detail = unused_because(e)
            if reason:
                unused[e.engine_id] = f"{reason}: {detail}"
                if self.unused.get(e.engine_id) != unused[e.engine_id]:
                    say = log.info if reason == "not_ready" else log.warning
                    say("engine_not_used", engine_id=e.engine_id, reason=reason, detail=detail)
                continue
            table = self.prefill if e.role == pb.ROLE_PREFILL else self.decode
            eng = table.get(e.engine_id) or Engine(e.engine_id, e.api_url.rstrip("/"))
            eng.url, eng.inflight = e.api_url.rstrip("/"), e.inflight_transfers
            eng.tp_size, eng.shape = e.tp_size, shape_of(e)
            eng.recompute = e.on_transfer_failure != pb.ON_TRANSFER_FAILURE_FAIL
            seen[e.role][e.engine_id] = eng
        self.unused = unused
        self._note_unlisted(seen[pb.ROLE_DECODE])
        self.prefill, self.decode = seen[pb.ROLE_PREFILL], seen[pb.ROLE_DECODE]
        self.pairs, refusals = [], []
        refused: set[str] = set()
        for d in sorted(self.decode.values(), key=lambda e: e.engine_id):
            for p in sorted(self.prefill.values(), key=lambda e: e.engine_id):
                why = pair_mismatch(p.tp_size, p.shape, d.tp_size, d.shape)
                if why:
                    refusals.append(f"{p.engine_id} -> {d.engine_id}: {why}")
                    refused.add(refusals[-1])
                    if refusals[-1] not in self._refused:  # said once while it lasts
                        log.info(
                            "pair_not_used", prefill=p.engine_id, decode=d.engine_id, reason=why
                        )
                else:
                    self.pairs.append((p, d))
        self._refused = refused
        self.unpaired = ""
        if refusals and not self.pairs:
            more = f"; and {len(refusals) - 3} more" if len(refusals) > 3 else ""
            self.unpaired = "; ".join(refusals[:3]) + more
        self.error = ""

    def unused_hint(self) -> str:
        """The listed engines not used and why, for a 503's detail ("" if none)."""
        if not self.unused:
            return ""
        items = sorted(self.unused.items())
        more = f"; and {len(items) - 3} more" if len(items) > 3 else ""
        return "; not used: " + "; ".join(f"{k} ({v})" for k, v in items[:3]) + more

    def _note_unlisted(self, listed: dict[str, Engine]) -> None:
        now = time.monotonic()
        for engine_id, eng in self.decode.items():
            if engine_id not in listed:
                self.unlisted[engine_id] = (eng, now + self.unlisted_grace_s)
        self.unlisted = {
            k: (e, until)
            for k, (e, until) in self.unlisted.items()
            if k not in listed and until > now
        }

    def pick_unlisted(self) -> Engine | None:
        """A decode engine listed until recently (within unlisted_grace_s), least loaded."""
        now = time.monotonic()
        live = {k: e for k, (e, until) in self.unlisted.items() if until > now}
        return self.pick(live)

    def pick(self, table: dict[str, Engine]) -> Engine | None:
        """Least loaded (coordinator in-flight + our open requests), round-robin on ties."""
        if not table:
            return None
        engines = sorted(table.values(), key=lambda e: e.engine_id)
        start = next(self._rr) % len(engines)
        rotated = engines[start:] + engines[:start]
        return min(rotated, key=lambda e: e.load)

    def pick_pair(self) -> tuple[Engine, Engine] | None:
        """The compatible pair with the least load (prefill + decode), round-robin
        on ties. Where every pair is compatible this is the least-loaded prefill
        and the least-loaded decode engine, as if picked apart."""
        if not self.pairs:
            return None
        start = next(self._rr) % len(self.pairs)
        rotated = self.pairs[start:] + self.pairs[:start]
        return min(rotated, key=lambda pd: pd[0].load + pd[1].load)
