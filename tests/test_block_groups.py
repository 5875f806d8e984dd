"""pushkv/rules/block_groups.py: a side's block ids per KV cache group, and its
two edges to the contract (`repeated BlockIds`) and to a WRITE (`flat`)."""

from __future__ import annotations

import pickle

from pushkv.rules.block_groups import flat, from_pb, lens, none, of, to_pb
from pushkv.v1 import pushkv_pb2 as pb


def test_the_contract_round_trip_keeps_every_group_and_its_order() -> None:
    for groups in (of((7, 3, 9)), of((1, 2, 3), (11, 12)), of((), ()), of()):
        req = pb.RegisterDecodeBlocksRequest(block_ids=to_pb(groups))
        wire = pb.RegisterDecodeBlocksRequest.FromString(req.SerializeToString())
        assert from_pb(wire.block_ids) == groups
        assert [list(g.ids) for g in wire.block_ids] == [list(g) for g in groups]


def test_a_write_pairs_the_groups_flat_group_after_group() -> None:
    one = of((4, 5, 6))
    assert flat(one) is one[0]  # one group: no copy
    assert flat(of((1, 2), (9,), ())) == (1, 2, 9)
    assert flat(of()) == ()
    assert lens(of((1, 2), (9,), ())) == (2, 1, 0)


def test_it_is_the_plain_tuple_at_run_time() -> None:
    """No wrapper object: equal to, hashed and pickled as the tuple of tuples
    (it crosses from vLLM's scheduler process to its workers)."""
    groups = of([1, 2], [3])
    assert type(groups) is tuple and groups == ((1, 2), (3,))
    assert hash(groups) == hash(((1, 2), (3,)))
    assert pickle.loads(pickle.dumps(groups)) == groups
    assert none(2) == ((), ()) and none(0) == ()
