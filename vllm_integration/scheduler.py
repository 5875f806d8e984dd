"""The connector's scheduler half (runs in vLLM's EngineCore process).

Decode: claims the uncached prompt suffix as an async load, registers exactly
those blocks with the coordinator right after allocation (off the engine
loop), and cancels the transfer if the request is aborted while waiting.

Prefill: marks the step whose forward computes a request's last prompt token
(`FireMsg`: the worker fires the transfer's armed order after that forward,
with no coordinator round trip), reports prefill done with the request's
blocks in request_finished (request_finished_all_groups) and keeps the blocks
until the worker's agent says they may be freed. A request aborted after it
fired keeps its blocks too, until the agent knows no WRITE reads them.

KV cache groups (vLLM's hybrid KV cache manager, e.g. sliding-window and
full-attention layers): both sides name each group's blocks of the prompt as a
tail ending at the prompt's last block. A sliding-window group holds only the
blocks of its window (vLLM's null block stands for the others), so its tail is
shorter; the coordinator writes each decode group's tail from the same token
positions of the prefill group (controlplane/orders.py, source_blocks).

One case no transfer can serve exactly (vLLM 0.32): after loading a whole
prompt of n tokens vLLM recomputes its last token, whose window reaches back to
token n - W; but both engines free the blocks before the window of token n
(SlidingWindowManager.get_num_skipped_tokens(n) = n - W + 1 tokens), and when
that count is a whole number of blocks the block holding token n - W is gone on
both sides. For such prompts the decode engine claims no external tokens and
computes the prompt itself, and cancels the transfer naming why (`window_edge`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pushkv.agent.messages import FireMsg
from pushkv.agent.placement import placed, resolve
from pushkv.net.tls import TLSFiles
from pushkv.rules import block_groups
from pushkv.vllm_integration import compat, faults
from pushkv.vllm_integration.client import Call, CoordinatorClient, needs_engine
from pushkv.vllm_integration.metadata import PushKVMetadata, RecvSpec
from pushkv.vllm_integration.params import DECODE_LEG, PREFILL_LEG, leg_tid, pushed_tokens
from pushkv.vllm_integration.settings import ConnectorSettings

log = logging.getLogger("pushkv.connector")

# The metadata of steps that start and end nothing: shared, so never mutated
# (the scheduler half only appends to its own `_meta`, never to these).
_EMPTY_BUSY = PushKVMetadata()
_EMPTY_IDLE = PushKVMetadata(idle=True)


class _Leg:
    """A prefill leg being computed: its transfer, prompt length and blocks so
    far (per KV group, from the scheduler's outputs), the whole prompt blocks
    a chunk's fire named (progressive push), and whether it was preempted
    after one (its blocks freed and recomputed: the final fire rewrites all)."""

    __slots__ = ("blocks", "chunked", "num_tokens", "restart", "transfer_id")

    def __init__(self, transfer_id: str, num_tokens: int) -> None:
        self.transfer_id, self.num_tokens = transfer_id, num_tokens
        self.blocks: list[list[int]] = []
        self.chunked = 0
        self.restart = False


class PushSchedulerHalf:
    def __init__(
        self,
        settings: ConnectorSettings,
        engine_id: str,
        block_size: int,
        kv_groups: int = 1,
        windows: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self._faults = faults.armed()  # None outside tests
        self.kv_groups = kv_groups  # KV cache groups (> 1: vLLM's hybrid KV cache manager)
        self._no_blocks = block_groups.none(kv_groups)  # a full local prefix hit's
        # Per sliding-window group: (window, tokens of a prompt of n tokens that
        # vLLM keeps besides n - window + 1: its extra_retained_tokens).
        self.windows = windows
        self.progressive = settings.progressive_push
        relayed = bool(settings.agent_coordinator) and settings.submit_through_relay
        cpus = resolve(settings.thread_cpus, cpu_engine=compat.cpu_platform())
        with placed(cpus):  # its thread and gRPC's inherit it
            self.client = CoordinatorClient(
                settings.agent_coordinator if relayed else settings.coordinator,
                timeout_s=settings.rpc_timeout_s,
                tls=TLSFiles() if relayed else settings.tls,  # the relay holds the node's identity
                keep=needs_engine,  # accepted calls never reach the engine thread
                resubmit=settings.rebuild_on_failover,
            )
        self._local_hit: dict[str, int] = {}  # request id -> block-aligned local hit tokens
        self._registered: set[str] = set()  # decode requests registered once
        self._waiting: dict[str, RecvSpec] = {}  # decode requests waiting for KV
        # Registrations whose outcome is unknown (coordinator unreachable):
        # request id -> when every order that might exist has passed its deadline.
        self._uncertain: dict[str, float] = {}
        self.uncertain_grace_s = settings.uncertain_grace_s
        self._meta = PushKVMetadata()
        # Prefill legs scheduled but not computed to their last prompt token,
        # and those fired (their armed order may have posted a WRITE).
        self._legs: dict[str, _Leg] = {}
        self._fired: set[str] = set()
        # Prefill requests reported done whose blocks are held: request id ->
        # transfer id. Their report stays open at the client (resubmitted after
        # a failover) until the worker frees the blocks (finished_sending).
        self._sending: dict[str, str] = {}
        # Decode requests whose registration was refused: cancelled at once (so
        # the prefill side frees its blocks now, not at the deadline), once.
        self._refused: set[str] = set()

    # ------------------------------------------------------------ decode
    # The per-request hooks below run on vLLM's engine thread, once or twice
    # per request: they read attributes directly and build no objects beyond
    # what they hand on (see docs/benchmarks.md, "Connector hooks").
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        raw = request.kv_transfer_params
        if raw is None:
            return 0, False
        rid = request.request_id
        if rid in self._registered:
            return 0, False
        if leg_tid(raw, DECODE_LEG, PREFILL_LEG) is None:
            tid = leg_tid(raw, PREFILL_LEG, DECODE_LEG)
            # Watched until it fires (again after a preemption: kept). A leg
            # that goes on decoding after its prompt (max_tokens > 1) may be
            # preempted with its blocks freed after it fired: it fires from
            # request_finished instead, when vLLM keeps its blocks for us.
            if (
                tid is not None
                and rid not in self._legs
                and rid not in self._fired
                and request.max_tokens == 1
            ):
                self._legs[rid] = _Leg(tid, request.num_prompt_tokens)
            return 0, False
        # A seeded leg's last prompt tokens are the prefill's samples: computed here.
        pushed = pushed_tokens(raw, request.num_prompt_tokens)
        # A seeded leg computes the position after the prefill's last, as the
        # prefill engine itself would next: its window's blocks are all held.
        seeded = pushed < request.num_prompt_tokens
        if self.windows and not seeded and self.window_edge(request.num_prompt_tokens):
            return 0, False  # computed here; update_state_after_alloc cancels
        self._local_hit[rid] = num_computed_tokens
        remaining = pushed - num_computed_tokens
        return (remaining, True) if remaining > 0 else (0, False)

    def window_edge(self, n: int) -> str:
        """Why no transfer can serve an n-token prompt exactly, or "" (see the
        module docstring): a sliding-window group frees, on both engines, the
        block holding token n - window, which the recomputed last token needs."""
        bs = self.block_size
        for window, extra in self.windows:
            skipped = n - window + 1 - extra
            if skipped > 0 and skipped % bs == 0:
                return (
                    f"decode computes this {n}-token prompt itself: vLLM's sliding-window "
                    f"KV cache group (window {window}, {bs}-token blocks) frees the block "
                    f"holding token {skipped - 1} on both engines, and the recomputed last "
                    "prompt token needs it"
                )
        return ""

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        raw = request.kv_transfer_params
        if raw is None:
            return
        rid = request.request_id
        if rid in self._registered:  # called again for the same request
            return
        tid = leg_tid(raw, DECODE_LEG, PREFILL_LEG)
        if tid is None:
            return
        self._registered.add(rid)
        n_tokens = pushed_tokens(raw, request.num_prompt_tokens)
        local = self._local_hit.pop(rid, 0)
        if num_external_tokens > 0:
            bs = self.block_size
            if self.kv_groups == 1:
                dst = compat.single_group(blocks, local // bs, -(-n_tokens // bs))
            else:
                # Per group the blocks decode holds of the uncached suffix (a
                # sliding-window group: its window's), each a tail ending at the
                # prompt's last block.
                dst = compat.all_groups(blocks, local // bs, -(-n_tokens // bs))
            spec = RecvSpec(rid, tid, dst)
            self._waiting[rid] = spec
            self._meta.recv.append(spec)
        else:
            seeded = n_tokens < request.num_prompt_tokens
            why = self.window_edge(n_tokens) if self.windows and not seeded else ""
            if why:
                # Computed here (get_num_new_matched_tokens claimed nothing):
                # the prefill side frees its blocks at once.
                self.client.submit(Call("cancel", rid, tid, reason=why))
                return
            # Full local prefix hit: nothing to write, but the coordinator must
            # learn it so the prefill side frees its blocks at once.
            dst = self._no_blocks
        self.client.submit(Call("register", rid, tid, self.engine_id, dst, n_tokens))

    # ------------------------------------------------------------ both
    def build_connector_meta(self, scheduler_output: Any) -> PushKVMetadata:
        if self.client.has_results():
            self._take_results()
        if self._legs:
            self._watch_legs(scheduler_output)
        if self._uncertain:
            now = time.monotonic()
            for rid in [r for r, dl in self._uncertain.items() if now >= dl]:
                del self._uncertain[rid]
                if rid in self._waiting:
                    self._meta.fail.append(self._waiting[rid])
        idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        meta = self._meta
        if not (meta.recv or meta.fail or meta.send or meta.free or meta.fire or meta.abort):
            return _EMPTY_IDLE if idle else _EMPTY_BUSY  # most steps
        self._meta = PushKVMetadata()
        meta.idle = idle
        return meta

    def _watch_legs(self, out: Any) -> None:
        """Follow each prefill leg's blocks through the step's output, and fire
        the legs whose last prompt token this step computes."""
        scheduled = getattr(out, "num_scheduled_tokens", None) or {}
        legs = self._legs
        for r in getattr(out, "scheduled_new_reqs", ()):
            leg = legs.get(r.req_id)
            if leg is not None:
                leg.blocks = [list(g) for g in r.block_ids]
                leg.restart = leg.restart or leg.chunked > 0  # rescheduled after a preemption
                self._step(r.req_id, leg, r.num_computed_tokens + scheduled.get(r.req_id, 0))
        cached = getattr(out, "scheduled_cached_reqs", None)
        if cached is None or not legs:
            return
        for i, rid in enumerate(cached.req_ids):
            leg = legs.get(rid)
            if leg is None:
                continue
            new = cached.new_block_ids[i]
            if new is not None:
                if rid in cached.resumed_req_ids or not leg.blocks:  # preempted: all anew
                    leg.blocks = [list(g) for g in new]
                    leg.restart = leg.restart or leg.chunked > 0
                else:
                    for have, more in zip(leg.blocks, new, strict=False):
                        have.extend(more)
            self._step(rid, leg, cached.num_computed_tokens[i] + scheduled.get(rid, 0))

    def _step(self, rid: str, leg: _Leg, computed: int) -> None:
        """This step computes the leg's prompt through token `computed`: the
        final fire if that is all of it, else (progressive push, one KV group,
        not preempted after a chunk) a chunk's fire when whole blocks were added."""
        if computed >= leg.num_tokens:
            del self._legs[rid]
            self._fired.add(rid)
            blocks = compat.held_groups(leg.blocks, leg.num_tokens, self.block_size)
            spec = FireMsg(leg.transfer_id, blocks, leg.num_tokens, restart=leg.restart)
            self._meta.fire.append(spec)
            return
        whole = computed // self.block_size
        if not self.progressive or leg.restart or len(leg.blocks) != 1 or whole <= leg.chunked:
            return
        leg.chunked = whole
        self._fired.add(rid)  # a chunk's WRITE may be in flight from now on
        so_far = compat.held_groups(leg.blocks, computed, self.block_size)  # every block so far
        spec = FireMsg(leg.transfer_id, so_far, leg.num_tokens, computed, final=False)
        self._meta.fire.append(spec)

    def _take_results(self) -> None:
        for res in self.client.drain():
            c = res.call
            if (
                c.kind == "register"
                and c.request_id in self._waiting
                and not res.ok
                and not (res.refused)
            ):
                # The coordinator could not be reached: it may or may not hold the
                # registration, so a WRITE may still be ordered. Cancel, and give
                # up only once any order would have passed its deadline.
                log.warning("registering %s failed (%s); cancelling", c.transfer_id, res.error)
                self.client.submit(
                    Call(
                        "cancel",
                        c.request_id,
                        c.transfer_id,
                        reason=f"registration outcome unknown: {res.error}",
                    )
                )
                self._uncertain[c.request_id] = time.monotonic() + self.uncertain_grace_s
            elif (
                c.kind == "cancel"
                and c.request_id in self._uncertain
                and res.ok
                and not res.write_may_land
                and c.request_id in self._waiting
            ):
                del self._uncertain[c.request_id]
                self._meta.fail.append(self._waiting[c.request_id])
            elif (
                c.kind == "register"
                and c.request_id in self._waiting
                and (res.refused or (res.terminal and not res.write_may_land))
            ):
                # Refused, unreachable or already ended: no WRITE was ordered,
                # so the blocks are safe; fail the load now instead of waiting.
                why = res.error or f"transfer already ended (state {res.state})"
                log.warning(
                    "transfer %s for %s cannot proceed: %s", c.transfer_id, c.request_id, why
                )
                self._meta.fail.append(self._waiting[c.request_id])
                if res.refused and c.request_id not in self._refused:
                    # Nothing recorded for decode, but the prefill side may
                    # report (or have reported, e.g. to a new leader whose
                    # agents were still coming back): it frees its blocks now.
                    self._refused.add(c.request_id)
                    reason = f"decode registration refused ({why[:300]}); decode computes it"
                    self.client.submit(Call("cancel", c.request_id, c.transfer_id, reason=reason))
            elif c.kind == "prefill_done" and (
                res.refused or (res.terminal and not res.write_may_land)
            ):
                # The transfer was refused or had already ended (e.g. cancelled by
                # the router): no order will read these blocks and the agent is
                # never told, so the worker frees them now. COMPLETE already:
                # an armed order fired and finished before this report came
                # (the agent freed the blocks itself; the normal case).
                why = res.error or f"transfer already ended (state {res.state})"
                (log.debug if res.complete and not res.refused else log.warning)(
                    "transfer %s: prefill blocks of %s freed at once: %s",
                    c.transfer_id,
                    c.request_id,
                    why,
                )
                self._meta.free.append((c.request_id, c.transfer_id))
                if res.refused:
                    # Nothing recorded for prefill, so no WRITE will come: a
                    # decode side already registered (or still to come) fails
                    # now and computes the prompt itself, instead of holding
                    # its blocks to the rendezvous deadline. A refusal for
                    # want of agents was ended by the coordinator itself: this
                    # cancel is then answered with that end.
                    reason = f"prefill report refused ({why[:300]}); decode computes it"
                    self.client.submit(Call("cancel", c.request_id, c.transfer_id, reason=reason))
            elif not res.ok:
                log.warning("coordinator %s for %s failed: %s", c.kind, c.transfer_id, res.error)

    def update_connector_output(self, output: Any) -> None:
        # A request stays in _registered until it finishes, so a recompute after
        # a failed load never registers (or waits) a second time. A transfer
        # loaded (or given up) or whose blocks were freed is settled: the client
        # resubmits nothing of it after a failover.
        for rid in getattr(output, "finished_recving", None) or ():
            spec = self._waiting.pop(rid, None)
            if spec is not None:
                self.client.settle(rid, spec.transfer_id)
            self._uncertain.pop(rid, None)
        if self._sending:
            for rid in getattr(output, "finished_sending", None) or ():
                tid = self._sending.pop(rid, None)
                if tid is not None:
                    self.client.settle(rid, tid)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's SupportsHMA hook, the one vLLM calls: every KV cache group's
        blocks of the request."""
        raw = request.kv_transfer_params
        if raw is None:
            return False, None
        rid = request.request_id
        if self._local_hit:
            self._local_hit.pop(rid, None)
        if rid in self._registered:  # a decode leg we registered
            self._registered.discard(rid)
            refused = False
            if self._refused and rid in self._refused:  # cancelled at the refusal
                self._refused.discard(rid)
                refused = True
            # A recompute after a failed load keeps the request registered, so
            # this is the request's end either way.
            if rid in self._waiting and not refused:
                self._cancel_decode(request, self._waiting[rid].transfer_id)
            return False, None
        tid = leg_tid(raw, PREFILL_LEG, DECODE_LEG)
        if tid is not None:
            leg = self._legs.pop(rid, None) if self._legs else None
            fired = rid in self._fired  # a WRITE of its blocks may have been posted
            if fired:
                self._fired.discard(rid)
            if request.status in compat.FINISHED_NORMALLY and any(block_ids):
                # Each group's blocks of the prompt that the engine holds, a
                # tail ending at the prompt's last block (a sliding-window
                # group: null blocks before its window dropped).
                groups = compat.held_groups(block_ids, request.num_prompt_tokens, self.block_size)
                # vLLM calls this as it processes the output of the request's
                # last forward: the timeline's "prefill_finished".
                self.client.submit(
                    Call(
                        "prefill_done",
                        rid,
                        tid,
                        self.engine_id,
                        groups,
                        request.num_prompt_tokens,
                        finished_unix=time.time(),
                    )
                )
                self._meta.send.append((rid, tid))
                self._sending[rid] = tid
                if leg is not None or not fired:  # no final fire yet: fire now, blocks held
                    restart = leg is not None and leg.chunked > 0
                    n = request.num_prompt_tokens
                    self._meta.fire.append(FireMsg(tid, groups, n, restart=restart))
                if self._faults is not None and self._faults.DIGEST:
                    self._meta.send_blocks[tid] = groups[0]
                return True, {"transfer_id": tid}
            self.client.submit(Call("cancel", rid, tid, reason="prefill request ended without KV"))
            if fired:
                # Its armed order may have posted a WRITE from these blocks:
                # held until the agent knows none is in flight.
                self._meta.send.append((rid, tid))
                self._meta.abort.append(tid)
                return True, {"transfer_id": tid}
            return False, None
        tid = leg_tid(raw, DECODE_LEG, PREFILL_LEG)
        if tid is not None:  # never registered, e.g. rejected before scheduling
            self._cancel_decode(request, tid)
        return False, None

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook for a connector without SupportsHMA: one KV cache group."""
        return self.request_finished_all_groups(request, (block_ids,))

    def _cancel_decode(self, request: Any, tid: str) -> None:
        """A decode leg ended before its KV arrived (aborted while waiting, load
        failed, or never scheduled): cancel, so the prefill side frees its blocks
        now instead of at the deadline. While a load is in flight vLLM keeps the
        blocks until a worker reports the request as received, which happens once
        no WRITE can land."""
        status = request.status
        what = "aborted" if status == compat.RequestStatus.FINISHED_ABORTED else "ended"
        self.client.submit(
            Call(
                "cancel",
                request.request_id,
                tid,
                reason=f"decode request {what} before its KV arrived ({status.name})",
            )
        )

    def has_pending_work(self) -> bool:
        return False

    def shutdown(self) -> None:
        self.client.close()
