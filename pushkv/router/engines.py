"""The router's view of the engines: what the coordinator lists (ListEngines),
and the (prefill, decode) pairs among them that the coordinator would accept
(pushkv/rules/pairing.py: the rule it applies where the two sides meet)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from pushkv.rules.pairing import KVShape, pair_mismatch
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg


@dataclass(slots=True)
class Engine:
    engine_id: str
    url: str
    inflight: int = 0  # as last reported by the coordinator
    local: int = 0  # requests this router has open on it
    tp_size: int = 1
    shape: KVShape = field(default_factory=lambda: KVShape(0))

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
        for e in engines:
            if not e.ready or not e.api_url or e.role not in seen:
                continue
            table = self.prefill if e.role == pb.ROLE_PREFILL else self.decode
            eng = table.get(e.engine_id) or Engine(e.engine_id, e.api_url.rstrip("/"))
            eng.url, eng.inflight = e.api_url.rstrip("/"), e.inflight_transfers
            eng.tp_size, eng.shape = e.tp_size, shape_of(e)
            seen[e.role][e.engine_id] = eng
        self._note_unlisted(seen[pb.ROLE_DECODE])
        self.prefill, self.decode = seen[pb.ROLE_PREFILL], seen[pb.ROLE_DECODE]
        self.pairs, refusals = [], []
        for d in sorted(self.decode.values(), key=lambda e: e.engine_id):
            for p in sorted(self.prefill.values(), key=lambda e: e.engine_id):
                why = pair_mismatch(p.tp_size, p.shape, d.tp_size, d.shape)
                if why:
                    refusals.append(f"{p.engine_id} -> {d.engine_id}: {why}")
                else:
                    self.pairs.append((p, d))
        self.unpaired = ""
        if refusals and not self.pairs:
            more = f"; and {len(refusals) - 3} more" if len(refusals) > 3 else ""
            self.unpaired = "; ".join(refusals[:3]) + more
        self.error = ""

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
