"""The state machine split by transfer id: K `Rendezvous` partitions behind
one core's interface (`--partitions K`, 1 by default: then the runtime holds
one `Rendezvous` and nothing here runs).

This is the seam of the partitioned leader (docs/reliability.md, "Past one
leader core"), in one process. What crosses it is what would cross a Unix
socket between a front and K partition processes:

- A transfer's every call goes to one partition, `partition_of(id, K)` (a
  CRC-32 of the id, the same in every process): its sides, cancel, reports,
  arrivals, adoption and reads. A transfer never moves, and K is fixed for
  the process's life.
- An agent's hello, each renewal and its disconnect go to every partition:
  each keeps its own copy of the registry, fed the same calls at the same
  clock, so the copies agree (engine readiness, leases, fencing). A hello's
  held transfers are split by partition.
- The clock ticks each partition; what several say of one agent is told once
  (its peers' `SendPeerFenced`; one `AgentNotBack` with the transfers failed
  summed).
- Reads merge: the registry is partition 0's copy, counts are summed, a
  listing is merged newest first.
- Limits are per partition: each takes `ceil(limit / K)` of `max_inflight`,
  `max_inflight_per_engine` and `max_terminal`, as separate processes would
  (none sees another's counts). With ids spread by the hash, a limit is
  reached within a few percent of where one core reaches it; a partition
  that is full refuses while another may have room.

In one process this buys no speed: each agent event is applied K times
(about 5 % more CPU per TP-8 rendezvous at K = 2, `pushkv bench core
--seam 2`, docs/benchmarks.md). It is here so that the partitions' rules run
in every test before they move into processes of their own.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import zlib
from collections.abc import Iterable, Sequence
from typing import Protocol

from pushkv.controlplane.clock import Clock
from pushkv.controlplane.domain import (
    AgentKey,
    AgentNotBack,
    AgentRegistration,
    Effect,
    EngineId,
    HeldTransfer,
    Role,
    SendPeerFenced,
    WriteStatus,
)
from pushkv.controlplane.order_size import MAX_ORDER_BYTES
from pushkv.controlplane.registry import EngineRecord, Registry
from pushkv.controlplane.rendezvous import Rendezvous
from pushkv.controlplane.settings import CoreSettings
from pushkv.controlplane.transfer import Transfer
from pushkv.controlplane.transfer_filter import TransferFilter


class Core(Protocol):
    """What the runtime, the servicers and the metrics call on the core: a
    `Rendezvous`, or K of them as `Partitioned`."""

    @property
    def settings(self) -> CoreSettings: ...
    @property
    def registry(self) -> Registry: ...
    @property
    def coordinator_id(self) -> str: ...
    @property
    def max_order_bytes(self) -> int: ...
    @property
    def inflight(self) -> int: ...
    @property
    def transfers_begun(self) -> int: ...

    def lead(self) -> None: ...
    def get(self, transfer_id: str) -> Transfer: ...
    def find(self, flt: TransferFilter, limit: int) -> tuple[list[Transfer], int]: ...
    def transfers(self) -> Iterable[Transfer]: ...
    def engines(self) -> list[EngineRecord]: ...
    def inflight_for(self, engine_id: EngineId) -> int: ...
    def open_orders_of(self, key: AgentKey, incarnation: str) -> int: ...
    def has_transfer(self, transfer_id: str) -> bool: ...
    def transfer(self, transfer_id: str) -> Transfer | None: ...
    def agent_hello(
        self, reg: AgentRegistration, held: Sequence[HeldTransfer] = (), *, adopt: bool = False
    ) -> list[Effect]: ...
    def agent_seen(self, key: AgentKey, incarnation: str) -> bool: ...
    def agent_disconnected(
        self, key: AgentKey, incarnation: str, *, link_lost: bool = False
    ) -> list[Effect]: ...
    def write_report(
        self,
        key: AgentKey,
        incarnation: str,
        order_id: str,
        transfer_id: str,
        status: WriteStatus,
        detail: str = "",
        nbytes: int = 0,
        descriptors: int = 0,
        posts: int = 0,
        at_unix: float = 0.0,
    ) -> list[Effect]: ...
    def arrival_report(
        self,
        key: AgentKey,
        incarnation: str,
        transfer_id: str,
        prefill_ranks: Sequence[int],
        at_unix: float = 0.0,
    ) -> list[Effect]: ...
    def begin(
        self, transfer_id: str, prefill_engine: str, decode_engine: str
    ) -> tuple[Transfer, list[Effect]]: ...
    def register_decode(
        self,
        transfer_id: str,
        engine: str,
        blocks: Sequence[Sequence[int]],
        num_tokens: int,
        resubmitted: bool = False,
    ) -> tuple[Transfer, list[Effect]]: ...
    def prefill_done(
        self,
        transfer_id: str,
        engine: str,
        blocks: Sequence[Sequence[int]],
        num_tokens: int,
        finished_unix: float = 0.0,
        resubmitted: bool = False,
    ) -> tuple[Transfer, list[Effect]]: ...
    def cancel(self, transfer_id: str, reason: str) -> tuple[Transfer, list[Effect]]: ...
    def side_refused(self, transfer_id: str, role: Role, engine: str, why: str) -> list[Effect]: ...
    def tick(self) -> list[Effect]: ...
    def next_wakeup(self) -> float | None: ...


def partition_of(transfer_id: str, k: int) -> int:
    """The partition that holds `transfer_id` among `k`: stable across
    processes and runs (Python's str hash is not)."""
    return zlib.crc32(transfer_id.encode("utf-8", "surrogatepass")) % k


def partition_settings(settings: CoreSettings, k: int) -> CoreSettings:
    """One partition's settings: each limit on held transfers its share."""
    return dataclasses.replace(
        settings,
        max_inflight=math.ceil(settings.max_inflight / k),
        max_inflight_per_engine=math.ceil(settings.max_inflight_per_engine / k),
        max_terminal=math.ceil(settings.max_terminal / k),
    )


def merged(lists: Iterable[list[Effect]]) -> list[Effect]:
    """The partitions' effects of one agent event, in order, with what
    several told of one agent told once: a peer's `SendPeerFenced` (each
    partition's registry copy fences it), and one `AgentNotBack` per agent
    incarnation with the transfers failed in every partition."""
    out: list[Effect] = []
    fenced: set[tuple[AgentKey, str, AgentKey, str]] = set()
    not_back: dict[tuple[AgentKey, str], AgentNotBack] = {}
    for effects in lists:
        for e in effects:
            if type(e) is SendPeerFenced:
                fk = (e.to, e.incarnation, e.peer, e.peer_incarnation)
                if fk in fenced:
                    continue
                fenced.add(fk)
            elif type(e) is AgentNotBack:
                nk = (e.key, e.incarnation)
                first = not_back.get(nk)
                if first is not None:
                    first.transfers_failed += e.transfers_failed
                    continue
                copy = AgentNotBack(e.key, e.incarnation, e.transfers_failed)  # summed in
                not_back[nk] = copy
                out.append(copy)
                continue
            out.append(e)
    return out


class Partitioned:
    """K `Rendezvous`, each holding the transfers whose id hashes to it."""

    def __init__(
        self,
        settings: CoreSettings,
        clock: Clock,
        max_order_bytes: int = MAX_ORDER_BYTES,
    ) -> None:
        k = settings.partitions
        if k < 2:
            raise ValueError(f"a partitioned core needs at least 2 partitions, got {k}")
        self.settings = settings
        self.max_order_bytes = max_order_bytes
        share = partition_settings(settings, k)
        self.parts = [Rendezvous(share, clock, max_order_bytes) for _ in range(k)]
        self.coordinator_id = self.parts[0].coordinator_id
        for i, p in enumerate(self.parts):
            p.coordinator_id = self.coordinator_id
            p.order_prefix = f"{self.coordinator_id}.{i}"

    def _of(self, transfer_id: str) -> Rendezvous:
        return self.parts[partition_of(transfer_id, len(self.parts))]

    # ================================================================ queries
    @property
    def registry(self) -> Registry:
        """Partition 0's copy (they all agree)."""
        return self.parts[0].registry

    @property
    def inflight(self) -> int:
        return sum(p.inflight for p in self.parts)

    @property
    def transfers_begun(self) -> int:
        return sum(p.transfers_begun for p in self.parts)

    def lead(self) -> None:
        for p in self.parts:
            p.lead()

    def get(self, transfer_id: str) -> Transfer:
        return self._of(transfer_id).get(transfer_id)

    def find(self, flt: TransferFilter, limit: int) -> tuple[list[Transfer], int]:
        found = [p.find(flt, limit) for p in self.parts]
        newest = heapq.merge(*(f[0] for f in found), key=lambda t: t.created_wall, reverse=True)
        return list(itertools.islice(newest, limit)), sum(f[1] for f in found)

    def transfers(self) -> Iterable[Transfer]:
        return itertools.chain.from_iterable(p.transfers() for p in self.parts)

    def engines(self) -> list[EngineRecord]:
        return self.parts[0].engines()

    def inflight_for(self, engine_id: EngineId) -> int:
        return sum(p.inflight_for(engine_id) for p in self.parts)

    def open_orders_of(self, key: AgentKey, incarnation: str) -> int:
        return sum(p.open_orders_of(key, incarnation) for p in self.parts)

    def has_transfer(self, transfer_id: str) -> bool:
        return self._of(transfer_id).has_transfer(transfer_id)

    def transfer(self, transfer_id: str) -> Transfer | None:
        return self._of(transfer_id).transfer(transfer_id)

    # ================================================================ agents
    def agent_hello(
        self, reg: AgentRegistration, held: Sequence[HeldTransfer] = (), *, adopt: bool = False
    ) -> list[Effect]:
        k = len(self.parts)
        split: list[list[HeldTransfer]] = [[] for _ in range(k)]
        for h in held:
            split[partition_of(h.transfer_id, k)].append(h)
        # A bad hello raises in partition 0, before any copy changed (the
        # check is the same in each).
        return merged(
            p.agent_hello(reg, part, adopt=adopt) for p, part in zip(self.parts, split, strict=True)
        )

    def agent_seen(self, key: AgentKey, incarnation: str) -> bool:
        seen = [p.agent_seen(key, incarnation) for p in self.parts]  # every copy renews
        return all(seen)

    def agent_disconnected(
        self, key: AgentKey, incarnation: str, *, link_lost: bool = False
    ) -> list[Effect]:
        return merged(
            p.agent_disconnected(key, incarnation, link_lost=link_lost) for p in self.parts
        )

    def write_report(
        self,
        key: AgentKey,
        incarnation: str,
        order_id: str,
        transfer_id: str,
        status: WriteStatus,
        detail: str = "",
        nbytes: int = 0,
        descriptors: int = 0,
        posts: int = 0,
        at_unix: float = 0.0,
    ) -> list[Effect]:
        return self._of(transfer_id).write_report(
            key,
            incarnation,
            order_id,
            transfer_id,
            status,
            detail,
            nbytes,
            descriptors,
            posts,
            at_unix,
        )

    def arrival_report(
        self,
        key: AgentKey,
        incarnation: str,
        transfer_id: str,
        prefill_ranks: Sequence[int],
        at_unix: float = 0.0,
    ) -> list[Effect]:
        return self._of(transfer_id).arrival_report(
            key, incarnation, transfer_id, prefill_ranks, at_unix
        )

    # ================================================================ requests
    def begin(
        self, transfer_id: str, prefill_engine: str, decode_engine: str
    ) -> tuple[Transfer, list[Effect]]:
        return self._of(transfer_id).begin(transfer_id, prefill_engine, decode_engine)

    def register_decode(
        self,
        transfer_id: str,
        engine: str,
        blocks: Sequence[Sequence[int]],
        num_tokens: int,
        resubmitted: bool = False,
    ) -> tuple[Transfer, list[Effect]]:
        return self._of(transfer_id).register_decode(
            transfer_id, engine, blocks, num_tokens, resubmitted
        )

    def prefill_done(
        self,
        transfer_id: str,
        engine: str,
        blocks: Sequence[Sequence[int]],
        num_tokens: int,
        finished_unix: float = 0.0,
        resubmitted: bool = False,
    ) -> tuple[Transfer, list[Effect]]:
        return self._of(transfer_id).prefill_done(
            transfer_id, engine, blocks, num_tokens, finished_unix, resubmitted
        )

    def cancel(self, transfer_id: str, reason: str) -> tuple[Transfer, list[Effect]]:
        return self._of(transfer_id).cancel(transfer_id, reason)

    def side_refused(self, transfer_id: str, role: Role, engine: str, why: str) -> list[Effect]:
        return self._of(transfer_id).side_refused(transfer_id, role, engine, why)

    # ================================================================ time
    def tick(self) -> list[Effect]:
        return merged(p.tick() for p in self.parts)

    def next_wakeup(self) -> float | None:
        return min((w for p in self.parts if (w := p.next_wakeup()) is not None), default=None)


def make_core(settings: CoreSettings, clock: Clock, max_order_bytes: int = MAX_ORDER_BYTES) -> Core:
    """The core `settings` ask for: one `Rendezvous`, or `partitions` of them."""
    if settings.partitions == 1:
        return Rendezvous(settings, clock, max_order_bytes)
    return Partitioned(settings, clock, max_order_bytes)
