"""Armed orders (pushkv.proto, TransferOrder.armed): orders that arrived before
their request's last prefill forward, and fires that came before their order.

Owned by the NIXL thread (agent/dataplane.py); plain Python, no NIXL. An armed
order and its fire meet exactly once, in either order: the pair becomes one
ordinary order with the source blocks filled in, queued to post.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from pushkv.agent.messages import FireMsg, OrderMsg
from pushkv.rules.block_groups import lens
from pushkv.rules.prompt_blocks import prompt_shortfall, prompt_tails

# Fires remembered for an order not here yet (bounded: the oldest go first;
# a fire whose order never comes was for a transfer that was not armed).
REMEMBER_FIRES = 50_000


class Armed:
    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self._orders: dict[str, OrderMsg] = {}  # transfer id -> its armed order
        self._ids: dict[str, str] = {}  # order id -> transfer id
        self._fires: OrderedDict[str, FireMsg] = OrderedDict()  # transfer id -> fire

    def __len__(self) -> int:
        return len(self._orders)

    def holds(self, order_id: str) -> bool:
        return order_id in self._ids

    def orders(self) -> list[OrderMsg]:
        """The armed orders held (not fired yet)."""
        return list(self._orders.values())

    def arm(self, order: OrderMsg) -> FireMsg | None:
        """Keep `order` until its fire; returns the fire if it came first."""
        fire = self._fires.pop(order.transfer_id, None)
        if fire is None:
            self._orders[order.transfer_id] = order
            self._ids[order.order_id] = order.transfer_id
        return fire

    def fire(self, fire: FireMsg) -> OrderMsg | None:
        """The request's prompt is computed: returns its armed order, if here."""
        order = self._orders.pop(fire.transfer_id, None)
        if order is not None:
            del self._ids[order.order_id]
            return order
        self._fires[fire.transfer_id] = fire
        while len(self._fires) > REMEMBER_FIRES:
            self._fires.popitem(last=False)
        return None

    def forget_fire(self, transfer_id: str) -> None:
        """An ordinary order came for the transfer: it names its blocks itself."""
        if self._fires:
            self._fires.pop(transfer_id, None)

    def cancel(self, order_id: str) -> OrderMsg | None:
        tid = self._ids.pop(order_id, None)
        return self._orders.pop(tid) if tid is not None else None

    def drop(self, transfer_id: str) -> OrderMsg | None:
        """The transfer ended or its request was aborted: its order, unfired."""
        self._fires.pop(transfer_id, None)
        order = self._orders.pop(transfer_id, None)
        if order is not None:
            del self._ids[order.order_id]
        return order

    def take_all(self) -> list[OrderMsg]:
        orders = list(self._orders.values())
        self._orders.clear()
        self._ids.clear()
        self._fires.clear()
        return orders


def filled(order: OrderMsg, fire: FireMsg, tokens_per_block: int) -> OrderMsg | str:
    """The armed order with its targets' source blocks from the fire (the rule
    the coordinator applies, pushkv/rules/prompt_blocks.py), or why it cannot be."""
    if fire.num_tokens != order.num_tokens:
        return f"num_tokens: decode {order.num_tokens} != prefill {fire.num_tokens}"
    targets = []
    for t in order.targets:
        dst_lens = lens(t.dst)
        why = prompt_shortfall(fire.blocks, dst_lens, fire.num_tokens, tokens_per_block)
        if why:
            return why
        src = prompt_tails(fire.blocks, dst_lens, fire.num_tokens, tokens_per_block)
        targets.append(dataclasses.replace(t, src=src))
    return dataclasses.replace(order, targets=tuple(targets), armed=False)
