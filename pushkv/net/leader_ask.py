"""Asking another coordinator replica which one leads (GetLeadership).

A client whose coordinator is silent asks the other replicas in turn, ASK_S
each (pushkv/net/silence.py, `ask_due`), and takes the first that names a leader;
`pushkv.net.leader.go_to` then decides whether it moves there. The agent's link
asks from its watchdog thread (`ask`); a node relay and the cluster bench's
simulated ranks from their event loops (`ask_aio`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

from pushkv.net.silence import ASK_S
from pushkv.v1 import pushkv_pb2 as pb
from pushkv.v1 import pushkv_pb2_grpc as pbg

NONE_NAMED = ("", 0)


def ask(
    addresses: Sequence[str],
    dialed: str,
    channel_for: Callable[[str], grpc.Channel],
    stop: Callable[[], bool] = lambda: False,
) -> tuple[str, int]:
    """The leader a replica other than `dialed` names and its term, or
    ("", 0) when none answers within ASK_S or knows one. Each channel from
    `channel_for` is closed after its question; `stop` ends the round early."""
    for address in addresses:
        if address == dialed or stop():
            continue
        channel = channel_for(address)
        try:
            view = pbg.StatusServiceStub(channel).GetLeadership(
                pb.GetLeadershipRequest(), timeout=ASK_S
            )
        except grpc.RpcError:
            continue
        finally:
            channel.close()
        if view.leader:
            return str(view.leader), int(view.term)
    return NONE_NAMED


async def ask_aio(
    addresses: Sequence[str],
    dialed: str,
    channel_for: Callable[[str], Any],
    owned: bool = True,
) -> tuple[str, int]:
    """`ask` on an event loop. `channel_for` gives a grpc.aio channel; with
    `owned` it is closed after its question, else the caller keeps it (one
    shared channel per replica, as the cluster bench's many ranks use)."""
    for address in addresses:
        if address == dialed:
            continue
        channel = channel_for(address)
        try:
            view = await pbg.StatusServiceStub(channel).GetLeadership(
                pb.GetLeadershipRequest(), timeout=ASK_S
            )
        except grpc.aio.AioRpcError:
            continue
        finally:
            if owned:
                await channel.close(None)
        if view.leader:
            return str(view.leader), int(view.term)
    return NONE_NAMED
