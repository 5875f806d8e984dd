"""The decode engine killed (kill -9 of its whole process group) with
transfers into it in flight, real vLLM engines behind the router
(docs/reliability.md, the fault matrix's "decode engine killed" rows).

The prefill engine holds its finished prefills' armed orders unfired (the
test hook hold_fire, vllm_integration/fault_hooks.py), so the kill finds
every transfer of a burst registered by decode, whatever the machine's
speed. Two cases: killed before the WRITEs (the prefill workers are released
at a dead engine), and killed after them (decode frozen first, the WRITEs
fired at it, then killed: no decode rank counted them). What must hold:

- every request of the burst ends within a deadline with the router's clean
  502 naming the decode engine, none hangs;
- the coordinator ends every transfer of the burst (none COMPLETE, no rank
  arrived), none may still land a WRITE, and the dead engine is no longer
  ready;
- the prefill engine frees every block it held for them, and keeps serving;
- the router drops the dead engine, and a replacement decode engine
  registers and serves: answers equal to an independent engine with no
  connector, and a transfer pushed into it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.vllm_server import RouterProcess, VllmServer, pushkv_server
from pushkv.v1 import pushkv_pb2 as pb
from tests.support import serving, waits
from tests.support.reference import ReferenceEngines
from tests.support.serving import post_status

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

COORDINATOR = (
    *("--lease-s", "2", "--heartbeat-interval-s", "0.5", "--write-timeout-s", "3"),
    *("--log-level", "INFO"),
)
ANSWER_S = 90.0  # every request answered within this (two engines on two cores)
DEADLINE_S = 60.0
MAX_TOKENS = 8
BURST = serving.varied_prompts(41, (200, 150, 120, 90, 60, 40))
FRESH = serving.varied_prompts(42, (80, 70, 50, 45, 44, 43, 42, 41))
# The second case's own prompts: one served before is a prefix hit at prefill.
BURST2 = serving.varied_prompts(43, (190, 140, 110, 85, 55, 35))
FRESH2 = serving.varied_prompts(44, (78, 68, 48, 46, 47, 49, 51, 52))
PROMPTS = BURST + FRESH + BURST2 + FRESH2
# A rank whose WRITE the prefill agent fired: posted, or already reported.
FIRED = (pb.RANK_STATE_POSTED, pb.RANK_STATE_DONE, pb.RANK_STATE_FAILED)


def body(prompt: list[int]) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}


def router_decode(c: Cluster) -> list[str]:
    """The decode engines the router pairs requests with (its /health)."""
    return serving.router_engines(c.router.url, "decode")


def poll(what: str, check: Callable[[], Any], timeout: float = DEADLINE_S) -> Any:
    """waits.poll with this module's deadline."""
    return waits.poll(what, check, timeout)


@dataclass
class Cluster:
    model: Path
    coord: CoordinatorProcess
    prefill: VllmServer
    decode: VllmServer
    router: RouterProcess
    reference: dict[tuple[int, ...], str]
    hold: Path  # while it exists, the prefill engine holds its armed orders
    decode_id: str = "decode-dk-0"

    def complete(self, prompt: list[int]) -> tuple[int, Any]:
        return post_status(self.router.url + "/v1/completions", body(prompt), ANSWER_S)

    def decode_server(self, engine_id: str) -> VllmServer:
        return pushkv_server(self.model, "decode", engine_id, self.coord.address, cpu_core=1)


@pytest.fixture(scope="module")
def cluster(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, references: ReferenceEngines
) -> Iterator[Cluster]:
    hold = tmp_path_factory.mktemp("decode-killed") / "hold-fire"
    outputs = references.outputs(tiny_model_dir, PROMPTS, MAX_TOKENS)
    assert len(set(outputs)) > 1, "the reference cannot tell answers apart"
    reference = {tuple(p): o for p, o in zip(PROMPTS, outputs, strict=True)}
    coord = CoordinatorProcess(*COORDINATOR).start()
    prefill = pushkv_server(
        tiny_model_dir,
        "prefill",
        "prefill-dk",
        coord.address,
        cpu_core=0,
        env={"PUSHKV_TEST_FAULT": f"hold_fire:{hold}"},
    )
    c = Cluster(tiny_model_dir, coord, prefill, None, RouterProcess(coord.address), reference, hold)  # type: ignore[arg-type]
    c.decode = c.decode_server("decode-dk-0")
    try:
        c.prefill.start()
        c.decode.start()
        c.prefill.wait_ready()
        c.decode.wait_ready()
        c.router.start()
        yield c
    finally:
        hold.unlink(missing_ok=True)
        c.router.stop()
        c.prefill.stop()
        c.decode.stop()
        coord.stop()


def test_decode_engine_killed_before_the_writes(cluster: Cluster) -> None:
    """Killed with the burst registered and its orders armed, not fired."""
    states = kill_decode_mid_burst(cluster, BURST, FRESH, "decode-dk-1", written=False)
    print(f"\ndecode killed before the WRITEs: the transfers ended {states}")


def test_decode_engine_killed_after_the_writes(cluster: Cluster) -> None:
    """Frozen first (SIGSTOP: its connections stay open), the burst's WRITEs
    fired at it (every rank posted or done at the coordinator), then killed:
    the data may have landed, but no decode rank counted it."""
    states = kill_decode_mid_burst(cluster, BURST2, FRESH2, "decode-dk-2", written=True)
    print(f"\ndecode killed after the WRITEs: the transfers ended {states}")


def kill_decode_mid_burst(
    c: Cluster, burst: list[list[int]], fresh_prompts: list[list[int]], new_id: str, written: bool
) -> list[str]:
    """A burst in flight into the decode engine when it is killed; the checks
    of the module's docstring; how the burst's transfers ended."""
    dead_id = c.decode_id
    # A pushed transfer first: the deployment works.
    p = fresh_prompts[0]
    status, answer = c.complete(p)
    assert status == 200 and answer["choices"][0]["text"] == c.reference[tuple(p)], answer
    before = {t.transfer_id for t in serving.transfers(c.coord.address)}

    c.hold.touch()
    try:
        pool = ThreadPoolExecutor(len(burst))
        futures: list[Future[tuple[int, Any]]] = [pool.submit(c.complete, q) for q in burst]
        pool.shutdown(wait=False)

        def registered() -> set[str]:
            """The burst's transfers, once each is live with decode's side in."""
            live = {
                t.transfer_id
                for t in serving.transfers(c.coord.address)
                if t.transfer_id not in before
                and t.state not in serving.TERMINAL
                and t.decode_engine_id == dead_id
                and t.decode_blocks
            }
            return live if len(live) == len(burst) else set()

        ids = poll("every transfer of the burst registered by decode", registered)
        assert c.decode.proc is not None
        if written:
            os.killpg(c.decode.proc.pid, signal.SIGSTOP)
            c.hold.unlink()

            def fired() -> bool:
                ts = [t for t in serving.transfers(c.coord.address) if t.transfer_id in ids]
                return len(ts) == len(ids) and all(
                    t.ranks and all(r.state in FIRED for r in t.ranks) for t in ts
                )

            poll("every rank of the burst's transfers fired at the frozen decode", fired)
        os.killpg(c.decode.proc.pid, signal.SIGKILL)  # the API server, its engine, its worker
        c.decode.proc.wait(DEADLINE_S)
    finally:
        c.hold.unlink(missing_ok=True)  # not written: the prefill workers fire at a dead engine

    # Every request ends with the router's clean answer; none hangs.
    for f in futures:
        status, answer = f.result(timeout=ANSWER_S)
        assert status == 502, (status, answer)
        assert "decode engine" in answer["error"]["message"], answer

    # The coordinator ends them all (none complete: no decode rank counted an
    # arrival); none may still land a WRITE; the dead engine is not ready.
    def ended() -> list[pb.TransferStatus]:
        ts = [t for t in serving.transfers(c.coord.address) if t.transfer_id in ids]
        done = [t for t in ts if t.state in serving.TERMINAL and not t.write_may_land]
        return done if len(done) == len(ids) else []

    ends = poll("every transfer of the burst ended", ended)
    for t in ends:
        assert t.state != pb.TRANSFER_STATE_COMPLETE, t
        assert not any(r.arrived for r in t.ranks), t
    poll(
        "the dead decode engine not ready",
        lambda: not getattr(serving.engines(c.coord.address).get(dead_id), "ready", False),
    )
    # The prefill engine frees what it held for them.
    serving.wait_no_blocks_held(c.prefill, timeout=DEADLINE_S)

    # The router drops the dead engine, and takes in its replacement, which
    # registers and serves, with KV pushed into it.
    poll("the router without the dead decode engine", lambda: router_decode(c) == [])
    c.decode_id = new_id
    c.decode = c.decode_server(new_id).start().wait_ready()
    poll("the router with the new decode engine", lambda: router_decode(c) == [new_id])
    fresh = iter(fresh_prompts[1:])

    def served() -> bool:
        q = next(fresh, None)
        assert q is not None, f"not pushed within {len(fresh_prompts) - 1} fresh prompts"
        status, answer = c.complete(q)
        assert status == 200 and answer["choices"][0]["text"] == c.reference[tuple(q)], answer
        return any(
            t.state == pb.TRANSFER_STATE_COMPLETE
            and t.reason != pb.REASON_NOTHING_TO_WRITE
            and t.decode_engine_id == new_id
            for t in serving.transfers(c.coord.address)
        )

    poll("a transfer pushed into the replacement decode engine", served)
    serving.wait_no_blocks_held(c.prefill, c.decode, timeout=DEADLINE_S)
    return sorted(
        f"{pb.TransferState.Name(t.state)[15:]}/{pb.Reason.Name(t.reason)[7:]}"
        f" ranks {[pb.RankState.Name(r.state)[11:] for r in t.ranks]}"
        for t in ends
    )
