"""How many bytes an order takes on the wire, bounded from above, so that one
too large for the gRPC message limit fails its transfer with a clear reason
instead of ending its agent's stream at every replay.

Plain Python (no protobuf): the bound counts every field at its widest
varint and tag, and each block id at the width of its group's largest id."""

from __future__ import annotations

from pushkv.controlplane.domain import Order
from pushkv.rules.block_groups import BlockGroups, flat

# The gRPC default; the server passes its --max-message-bytes.
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
# What wraps an order on its way (CoordinatorMessage, a batch, a ChannelDown
# in a NodeDown): a few tags and lengths, with room to spare.
ENVELOPE_BYTES = 1024
# Agents receive at gRPC's default limit: an order must fit it whatever the
# coordinator's own limit is.
AGENT_RECEIVE_BYTES = 4 << 20
MAX_ORDER_BYTES = DEFAULT_MAX_MESSAGE_BYTES - ENVELOPE_BYTES
_FIELD = 11  # a tag and the widest 64-bit varint
_LEN = 6  # a tag and a length prefix up to 2**28


class OrderTooLarge(Exception):
    """The orders of a transfer cannot be sent: the caller fails it."""


def max_order_bytes(max_message_bytes: int) -> int:
    """The bound on one order, given the coordinator's message limit."""
    return min(max_message_bytes, AGENT_RECEIVE_BYTES) - ENVELOPE_BYTES


def _varint(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _text(s: str) -> int:
    """At least its UTF-8 length."""
    return len(s) if s.isascii() else 4 * len(s)


def _ids(groups: BlockGroups, fast: bool) -> int:
    total = 0
    plain: tuple[tuple[int, ...], ...] = groups  # mypyc iterates no NewType
    for ids in plain:
        width = 5 if fast or not ids else _varint(max(ids))
        total += _LEN + _LEN + width * len(ids)  # BlockIds, its packed ids
    return total


def order_bytes(o: Order, fast: bool = False) -> int:
    """At least the encoded size of `o` as a TransferOrder (`fast`: every id at
    5 bytes, the widest uint32, without looking at the ids)."""
    n = 8 * _FIELD + _LEN * 3 + _text(o.order_id) + _text(o.transfer_id)
    n += _text(o.prefill_incarnation)
    for t in o.targets:
        n += _LEN + 12 * _FIELD + _text(t.decode_engine_id) + _text(t.decode_incarnation)
        n += _ids(t.src_blocks, fast) + _ids(t.dst_blocks, fast)
        n += 2 * _LEN + 5 * (len(t.head_span_units) + len(t.dst_regions))
    return n


def check(orders: list[Order], max_bytes: int) -> None:
    """Raises OrderTooLarge naming the largest of `orders` if it passes `max_bytes`."""
    if all(order_bytes(o, fast=True) <= max_bytes for o in orders):
        return  # the common case: lengths only
    o = max(orders, key=order_bytes)
    size = order_bytes(o)
    if size > max_bytes:
        ids = sum(len(flat(t.src_blocks)) + len(flat(t.dst_blocks)) for t in o.targets)
        raise OrderTooLarge(
            f"the order for prefill rank {o.prefill_rank} would take up to {size} bytes "
            f"({len(o.targets)} targets, {ids} block ids), over the {max_bytes}-byte "
            "message limit (the coordinator's --max-message-bytes)"
        )
