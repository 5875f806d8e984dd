"""The agent facade embedded in a worker rank: two owned threads and a host API.

Host calls never block on the network: commands go into the NIXL thread's
queue, and events come back through a queue the host drains when it likes.
"""

from __future__ import annotations

import collections
import enum
import itertools
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from pushkv.agent.dataplane import DataPlane
from pushkv.agent.events import HostEvent
from pushkv.agent.link import ChannelFactory, CoordinatorLink
from pushkv.agent.messages import AbortMsg, ExpectMsg, FireMsg, HoldMsg, PauseMsg, SnapshotMsg
from pushkv.agent.nixl_adapter import NixlEndpoint
from pushkv.agent.nixl_types import KVRegion, MemoryKind
from pushkv.agent.placement import placed
from pushkv.agent.snapshot import HeldItem
from pushkv.net.tls import TLSFiles
from pushkv.net.tls import channel as tls_channel
from pushkv.protocol import PROTOCOL_VERSION
from pushkv.v1 import pushkv_pb2 as pb


class AgentRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class AgentConfig:
    coordinator: str
    engine_id: str
    role: AgentRole
    tp_rank: int
    tp_size: int
    tokens_per_block: int
    regions: tuple[KVRegion, ...]
    memory: MemoryKind = MemoryKind.DRAM
    compat_hash: str = ""
    # What the peer engine must agree on besides TP (name, value), the KV heads
    # this rank holds per block, and whether a head range of a block is
    # contiguous: see KVLayout in pushkv.proto.
    compat: tuple[tuple[str, str], ...] = ()
    kv_heads: int = 0
    head_major: bool = False
    api_url: str = ""
    # Routers dispatch requests to this engine (the connector sets it): the
    # coordinator then refuses a hello without api_url. False: an agent no
    # router uses (a KV host, an in-process engine).
    routable: bool = False
    # The engine's on_transfer_failure, published to routers through the
    # coordinator (ListEngines); unspecified reads as recompute.
    on_transfer_failure: pb.OnTransferFailure.ValueType = pb.ON_TRANSFER_FAILURE_UNSPECIFIED
    # mTLS to the coordinator; the certificate's CN must be "engine:<engine_id>".
    tls: TLSFiles = field(default_factory=TLSFiles)
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    # After losing the coordinator, how long the agent waits for it to come back
    # before resolving its transfers locally (decode: KV failed; prefill: blocks
    # freed). Must exceed the coordinator's write timeout plus an agent lease, so
    # that no WRITE can land after it.
    give_up_s: float = 30.0
    # KV cache groups whose blocks `regions` hold (vLLM's hybrid KV cache
    # manager: the groups share one block pool, a block id belongs to one group
    # at a time, and block b of any group lies in every region). The hello
    # lists the regions once per group; an order's groups are written alike.
    kv_groups: int = 1
    # Pipeline parallelism: this rank's stage and the engine's stage count,
    # and the model layer each of `regions` holds (KVRegion.layer; () = not
    # reported; a PP stage must report them).
    pp_rank: int = 0
    pp_size: int = 1
    region_layers: tuple[int, ...] = ()
    # Failover rebuild (docs/reliability.md): re-send the live transfers in
    # every hello, and let a newer leader of the same cluster adopt them
    # instead of resolving them locally. Off by default until the connector's
    # scheduler client resubmits its open transfers to a new leader (without
    # that, an adopted transfer waits for its rendezvous deadline).
    rebuild_on_failover: bool = False
    # > 0: if the link's watchdog does not run for this long, every Python
    # thread's stack goes to stderr (agent/starvation.py); 0: off.
    hang_dump_s: float = 0.0
    # The CPUs the agent's threads run on (agent/placement.py: resolve);
    # None: the starting thread's.
    cpus: frozenset[int] | None = None

    @property
    def rank(self) -> int:
        """The engine's rank number: pp_rank * tp_size + tp_rank."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def agent_name(self) -> str:
        return f"{self.engine_id}-r{self.rank}-{self.incarnation}"


class Agent:
    def __init__(self, config: AgentConfig, *, channel_factory: ChannelFactory | None = None):
        self.config = config
        # Events for the host: the NIXL thread appends, the host pops. The host's
        # poll is lock-free; `_event_ready` only wakes a host in wait_event.
        self._events: collections.deque[HostEvent] = collections.deque()
        self._event_ready = threading.Event()
        self._link: CoordinatorLink | None = None
        if channel_factory is None and config.tls.enabled:
            config.tls.material()  # unreadable or mismatched files fail here, named
            tls = config.tls

            # Each stream gets a new channel, made from the TLS files as they
            # are then (renewed certificates: pushkv/net/tls.py).
            def channel_factory(address: str) -> grpc.Channel:
                return tls_channel(address, tls)

        self._channel_factory = channel_factory
        self._snapshot_gen = itertools.count(1)  # next() is one C call: any thread
        self._dataplane = DataPlane(
            self._make_endpoint,
            is_prefill=config.role is AgentRole.PREFILL,
            emit_report=self._report,
            emit_event=self._emit_event,
            lease_ok=self._lease_ok,
            lease_renewing=self._lease_renewing,
            name=f"pushkv-nixl-{config.rank}",
            tokens_per_block=config.tokens_per_block,
        )

    def _make_endpoint(self) -> NixlEndpoint:
        ep = NixlEndpoint(self.config.agent_name, memory=self.config.memory)
        try:
            ep.register_kv(self.config.regions)
        except BaseException:
            ep.close()
            raise
        return ep

    def _emit_event(self, event: HostEvent) -> None:
        self._events.append(event)
        self._event_ready.set()

    def _report(self, msg: object) -> None:
        if self._link is not None:
            self._link.send(msg)  # type: ignore[arg-type]

    def _snapshot(self, timeout: float) -> tuple[HeldItem, ...] | None:
        """The NIXL thread's snapshot of the live transfers, taken after
        everything queued to it before (agent/snapshot.py); None if late."""
        gen = next(self._snapshot_gen)
        self._dataplane.inbox.put(SnapshotMsg(gen))
        return self._dataplane.snapshots.wait(gen, timeout)

    def _lease_ok(self) -> bool:
        return self._link is not None and self._link.lease_ok()

    def _lease_renewing(self) -> bool:
        return self._link is not None and self._link.lease_renewing()

    # ------------------------------------------------------------ lifecycle
    def start(self, *, wait_registered_s: float = 0.0) -> None:
        """Start both threads, on config.cpus. With wait_registered_s > 0, wait
        for the first Welcome."""
        with placed(self.config.cpus):  # the threads started here inherit it
            self._start_threads()
        if wait_registered_s > 0 and not self.wait_registered(wait_registered_s):
            why = (self._link.fatal_error if self._link else None) or "no answer"
            raise TimeoutError(f"agent not registered within {wait_registered_s} s: {why}")

    def _start_threads(self) -> None:
        c = self.config
        metadata = self._dataplane.start()
        hello = pb.AgentHello(
            protocol_version=PROTOCOL_VERSION,
            identity=pb.AgentIdentity(
                engine_id=c.engine_id,
                role=pb.ROLE_PREFILL if c.role is AgentRole.PREFILL else pb.ROLE_DECODE,
                tp_rank=c.tp_rank,
                tp_size=c.tp_size,
                incarnation=c.incarnation,
                pp_rank=c.pp_rank,
                pp_size=c.pp_size,
            ),
            nixl_agent_name=c.agent_name,
            nixl_metadata=metadata,
            api_url=c.api_url,
            routable=c.routable,
            on_transfer_failure=c.on_transfer_failure,
            layout=pb.KVLayout(
                tokens_per_block=c.tokens_per_block,
                regions=[
                    pb.KVRegion(
                        base_addr=r.base_addr,
                        block_len=r.block_len,
                        num_blocks=r.num_blocks,
                        device_id=r.device_id,
                        group=g,
                        name=f"region{i}" if g == 0 else f"group{g}-region{i}",
                        layer=c.region_layers[i] if c.region_layers else None,
                    )
                    for g in range(max(1, c.kv_groups))
                    for i, r in enumerate(c.regions)
                ],
                memory_kind=c.memory.value,
                compat_hash=c.compat_hash,
                compat=dict(c.compat),
                kv_heads=c.kv_heads,
                head_major=c.head_major,
            ),
        )
        self._link = CoordinatorLink(
            c.coordinator,
            hello,
            self._dataplane.inbox.put,
            channel_factory=self._channel_factory,
            name=f"pushkv-link-{c.rank}",
            give_up_s=c.give_up_s,
            snapshot=self._snapshot,
            rebuild=c.rebuild_on_failover,
            hang_dump_s=c.hang_dump_s,
        )
        self._link.start()

    def close(self) -> None:
        if self._link is not None:
            self._link.stop()
        self._dataplane.stop()

    # ------------------------------------------------------------ host API
    @property
    def registered(self) -> bool:
        return self._link is not None and self._link.registered.is_set()

    def wait_registered(self, timeout: float) -> bool:
        return self._link is not None and self._link.registered.wait(timeout)

    def expect(self, transfer_ids: Sequence[str]) -> None:
        """Decode: these transfers' blocks are registered; watch for their WRITEs."""
        self._dataplane.from_host(ExpectMsg(tuple(transfer_ids)))

    def hold(self, transfer_ids: Sequence[str]) -> None:
        """Prefill: these transfers' blocks are held until a BLOCKS_FREE event."""
        self._dataplane.from_host(HoldMsg(tuple(transfer_ids)))

    def fire(self, fires: Sequence[FireMsg]) -> None:
        """Prefill: these transfers' prompts (or, with final=False, a chunk of
        them) are computed: fire their armed orders (each posts once; an order
        still to come posts on arrival; a chunk's whole blocks are written at
        once, agent/progressive.py)."""
        put = self._dataplane.inbox.put
        for f in fires:
            put(f)

    def abort(self, transfer_ids: Sequence[str]) -> None:
        """Prefill: these held transfers' requests were aborted after they fired."""
        self._dataplane.inbox.put(AbortMsg(tuple(transfer_ids)))

    def pause_posting(self, paused: bool) -> None:
        """Prefill: hold new WRITEs (queued orders wait, cancel drops them) or resume."""
        self._dataplane.inbox.put(PauseMsg(paused))

    def poll_events(self) -> list[HostEvent]:
        """Everything that happened since the last call; never blocks."""
        events = self._events
        if not events:
            return []
        out: list[HostEvent] = []
        while events:
            out.append(events.popleft())
        return out

    def wait_event(self, timeout: float) -> HostEvent | None:
        """The next event, waiting up to `timeout` seconds for one."""
        if self._events:
            return self._events.popleft()
        self._event_ready.clear()
        # Re-check after clearing: an event emitted before the clear is queued.
        if not self._events:
            self._event_ready.wait(timeout)
        return self._events.popleft() if self._events else None

    @property
    def writes_posted(self) -> int:
        return self._dataplane.writes_posted

    @property
    def leader_term(self) -> int:
        """The newest leader term seen in a welcome (0: none, or no --etcd)."""
        return self._link.term if self._link is not None else 0

    def live_transfers(self, timeout: float = 5.0) -> tuple[HeldItem, ...] | None:
        """What a hello would re-send now (agent/snapshot.py); None if the NIXL
        thread did not answer within `timeout`."""
        return self._snapshot(timeout)

    @property
    def fast_polling(self) -> bool:
        """Whether the NIXL thread is polling fast (a snapshot, for tests)."""
        return self._dataplane.fast_polling

    @property
    def orders_fired(self) -> int:
        """Armed orders fired by this rank's own prefill (agent/armed.py)."""
        return self._dataplane.orders_fired

    @property
    def lease_held(self) -> bool:
        """Whether the coordinator acknowledged this agent within its lease
        (a prefill agent posts nothing otherwise)."""
        return self._lease_ok()

    @property
    def link_counts(self) -> tuple[int, int]:
        """Streams the link left for the coordinator's silence, and unanswered
        hellos it left because another replica named the leader elsewhere."""
        if self._link is None:
            return (0, 0)
        return (self._link.silenced, self._link.redirected)

    @property
    def orders_refused(self) -> int:
        """Orders refused for an older leader term (term fencing)."""
        return self._dataplane.orders_refused
