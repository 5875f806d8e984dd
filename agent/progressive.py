"""Progressive push: an armed order written chunk by chunk during a chunked
prefill (pushkv.proto, TransferOrder.armed; docs/architecture.md,
"Progressive push"). Owned by the NIXL thread (agent/dataplane.py).

A chunk's fire names the prompt tokens computed so far; every prompt block
they fill completely, and that decode holds, is written then, without a
notification. The final fire writes the rest with the notification, which
is attached to the last WRITE only once every earlier chunk is DONE (else it
is sent on its own once they are), so decode counts the rank's arrival only
after all of its bytes landed. The order stays one order: the coordinator
hears POSTED at the final fire, and one outcome once every chunk settled; a
cancel, notice or abort mid-prefill stops further chunks, and the outcome
(DROPPED) is reported, and the blocks freed, only when the posted ones settled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pushkv.agent.messages import FireMsg, OrderMsg, ReportStatus
from pushkv.agent.nixl_types import NixlError, PeerKey, WriteHandle
from pushkv.agent.posting import Poster, Write
from pushkv.rules.block_groups import BlockGroups

NO_GROUPS = BlockGroups(())  # a WRITE of no blocks: the notification alone

Finish = Callable[[OrderMsg, ReportStatus, str, int, int, int], None]
Posted = Callable[[OrderMsg, list[WriteHandle], tuple[tuple[PeerKey, bytes], ...], int], None]


@dataclass(slots=True)
class Partial:
    """An armed order some of whose chunks are posted."""

    order: OrderMsg
    handles: list[WriteHandle] = field(default_factory=list)
    sent: int = 0  # prompt blocks written so far (from the prompt's first)
    # Why nothing more is posted ("" while open), and the outcome reported
    # once every posted chunk settled.
    stopped: str = ""
    status: ReportStatus = ReportStatus.DROPPED
    # A final fire after a preemption, waiting for the chunks to settle, and
    # the posts of the chunks it replaced (released before the rewrite).
    restart: FireMsg | None = None
    replaced: int = 0

    def stop(self, status: ReportStatus, why: str) -> None:
        if not self.stopped:
            self.stopped, self.status = why, status


def progressive_ok(order: OrderMsg) -> bool:
    """Chunks are written only for one KV group with equal block sizes."""
    return all(len(t.dst) == 1 and t.resize is None for t in order.targets)


def chunk_writes(
    order: OrderMsg, fire: FireMsg, sent: int, tokens_per_block: int
) -> tuple[list[Write], int] | str:
    """The WRITEs a fire adds to the `sent` prompt blocks already written, and
    the new count of prompt blocks written; or why it cannot (a final fire
    writes through the prompt's last block, and names every target)."""
    n = order.num_tokens
    if fire.num_tokens != n:
        return f"num_tokens: decode {n} != prefill {fire.num_tokens}"
    if len(fire.blocks) != 1:
        return f"a chunk of {len(fire.blocks)} KV groups"
    n_prompt = math.ceil(n / tokens_per_block)
    upto = n_prompt if fire.final else min(fire.computed_tokens // tokens_per_block, n_prompt)
    held = fire.blocks[0]
    if len(held) < upto:
        return f"prefill holds {len(held)} blocks, {upto} of the prompt's are computed"
    writes: list[Write] = []
    for t in order.targets:
        dst = t.dst[0]  # one KV group (progressive_ok)
        first = n_prompt - len(dst)  # the prompt block decode's first block holds
        lo = max(sent, first)
        if lo < upto:
            src_part, dst_part = held[lo:upto], dst[lo - first : upto - first]
            writes.append((t, BlockGroups((src_part,)), BlockGroups((dst_part,))))
        elif fire.final:  # nothing left, but the notification still goes
            writes.append((t, NO_GROUPS, NO_GROUPS))
    return writes, max(upto, sent)


class Progressive:
    def __init__(self, tokens_per_block: int, finish: Finish, posted: Posted) -> None:
        self.tokens_per_block = tokens_per_block
        self._finish, self._posted = finish, posted
        self._by_tid: dict[str, Partial] = {}
        self._fires: list[tuple[Partial, FireMsg]] = []  # to post after the step's batch
        # A posted chunk may still be in progress: the NIXL thread polls fast
        # only then, not for the whole prefill (it shares the prefill's core).
        self._pending = False

    @property
    def pending(self) -> bool:
        # Only partials hold chunks in flight: with none left (the final fire
        # handed its WRITEs on as an ordinary posted order), nothing is, and
        # no poll would come to clear the flag.
        return self._pending and bool(self._by_tid)

    def __bool__(self) -> bool:
        return bool(self._by_tid)

    def __contains__(self, tid: object) -> bool:
        return tid in self._by_tid

    def holds(self, order_id: str) -> bool:
        return any(p.order.order_id == order_id for p in self._by_tid.values())

    def orders(self) -> list[OrderMsg]:
        """The partial orders (some of their chunks may be posted)."""
        return [p.order for p in self._by_tid.values()]

    def start(self, order: OrderMsg, fire: FireMsg) -> None:
        p = self._by_tid[order.transfer_id] = Partial(order)
        self._fires.append((p, fire))

    def fire(self, fire: FireMsg) -> bool:
        """A later chunk's or the final fire of a partial order: True if it was one."""
        p = self._by_tid.get(fire.transfer_id)
        if p is None:
            return False
        if not p.stopped:
            self._fires.append((p, fire))
        return True

    def stop(self, tid: str, status: ReportStatus, why: str) -> bool:
        p = self._by_tid.get(tid)
        if p is not None:
            p.stop(status, why)
        return p is not None

    def stop_order(self, order_id: str, why: str) -> bool:
        for p in self._by_tid.values():
            if p.order.order_id == order_id:
                p.stop(ReportStatus.DROPPED, f"{why} after {p.sent} blocks were posted")
                return True
        return False

    def stop_all(self, why: str) -> set[str]:
        for p in self._by_tid.values():
            p.stop(ReportStatus.DROPPED, why)
        return set(self._by_tid)

    # ------------------------------------------------------------ posting
    def post(self, poster: Poster, guard: Callable[[OrderMsg], str]) -> None:
        """Post the fires of this step (after its batch: a cancel in it wins)."""
        fires, self._fires = self._fires, []
        for p, fire in fires:
            if p.stopped or self._by_tid.get(p.order.transfer_id) is not p:
                continue
            why = guard(p.order)
            if why:
                p.stop(ReportStatus.DROPPED, why)
            elif fire.final and fire.restart and p.sent:
                p.restart = fire  # rewritten whole once the chunks posted settled
            else:
                self._post(poster, p, fire)

    def _post(self, poster: Poster, p: Partial, fire: FireMsg) -> None:
        plan = chunk_writes(p.order, fire, p.sent, self.tokens_per_block)
        if isinstance(plan, str):
            p.stop(ReportStatus.FAILED, f"armed order cannot fire: {plan}")
            return
        writes, upto = plan
        settled = fire.final and poster.all_done(p.handles)
        self._pending = True  # until the next poll says otherwise
        try:
            p.handles += poster.post(p.order, writes, notify=settled)
            notify: tuple[tuple[PeerKey, bytes], ...] = ()
            if fire.final and not settled:
                notify = tuple((poster.peer(t), poster.notif(p.order, t)) for t, _, _ in writes)
        except NixlError as exc:
            p.stop(ReportStatus.FAILED, str(exc))
            return
        p.sent = upto
        if fire.final:  # an ordinary posted order from now on
            del self._by_tid[p.order.transfer_id]
            self._posted(p.order, p.handles, notify, p.replaced)

    def poll(self, poster: Poster) -> None:
        """Report the stopped partials whose chunks settled; rewrite a
        preempted one whole once nothing of it is in flight."""
        self._pending = False
        for tid, p in list(self._by_tid.items()):
            pending, failure = poster.settle(p.handles)
            if failure:
                p.stop(ReportStatus.FAILED, failure)
            if pending:
                self._pending = True
                continue
            if p.restart is not None and not p.stopped:
                fire, p.restart = p.restart, None
                p.replaced += poster.release(p.handles)[2]
                p.handles, p.sent = [], 0
                self._post(poster, p, fire)
            elif p.stopped:
                del self._by_tid[tid]
                nbytes, descs, posts = poster.release(p.handles)
                self._finish(p.order, p.status, p.stopped, nbytes, descs, posts + p.replaced)
