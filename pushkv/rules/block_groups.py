"""One request side's block ids, one tuple per KV cache group: the one shape
they keep from the connector's scheduler half (vLLM's structures in,
vllm_integration/compat.py) through its coordinator calls, the coordinator's
transfers and orders, and the agent's orders and fires, to the WRITE that
pairs them (agent/posting.py). The only conversions are at the edges: vLLM's
structures in, the contract's repeated `BlockIds` out and in (`to_pb`,
`from_pb`), and the flat id list a WRITE pairs position by position (`flat`).

A NewType, not a class: at run time a BlockGroups is the plain tuple of
tuples, so building one costs what building the tuple does (these are built
per request on vLLM's engine thread), and it compares, hashes and pickles as
that tuple. mypy keeps the shape: only the constructors here and at the
edges make one. vLLM's hybrid KV cache manager gives several groups (e.g.
full attention and sliding window); every other model one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NewType

from pushkv.v1 import pushkv_pb2 as pb

__all__ = ["BlockGroups", "flat", "from_pb", "lens", "none", "of", "to_pb"]

BlockGroups = NewType("BlockGroups", tuple[tuple[int, ...], ...])


def of(*groups: Iterable[int]) -> BlockGroups:
    """The groups' ids, in group order: `of((1, 2), (7,))`."""
    return BlockGroups(tuple([tuple(g) for g in groups]))


def none(num_groups: int) -> BlockGroups:
    """`num_groups` empty groups (a side that holds no block to write)."""
    return BlockGroups(((),) * num_groups)


def from_pb(groups: Sequence[pb.BlockIds]) -> BlockGroups:
    """The contract's `repeated BlockIds`, one message per KV group."""
    if len(groups) == 1:  # the common case: one KV group
        return BlockGroups((tuple(groups[0].ids[:]),))  # a slice copies in one C call
    return BlockGroups(tuple([tuple(g.ids[:]) for g in groups]))


def to_pb(groups: BlockGroups) -> list[pb.BlockIds]:
    """As the contract's `repeated BlockIds`, one message per KV group."""
    return [pb.BlockIds(ids=g) for g in groups]


def flat(groups: BlockGroups) -> tuple[int, ...]:
    """Every group's ids as one list, group after group. Every group's block b
    lies in every KV region (one block pool), so a WRITE of two sides' groups
    pairs their flat lists position by position."""
    if len(groups) == 1:
        return groups[0]
    return tuple([b for g in groups for b in g])


def lens(groups: BlockGroups) -> tuple[int, ...]:
    """How many ids each group holds."""
    return tuple([len(g) for g in groups])
