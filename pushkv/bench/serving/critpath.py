"""Each request's critical path to its first token, stage by stage, p50 and p99.

Every boundary is a unix time taken by one process on this host (one clock):

sent               the client sends the request (pushkv/bench/serving/workload.py)
prefill_finished   pushkv: the prefill engine finished the request, i.e. vLLM
                   processed the output of its last forward (the connector's
                   request_finished stamps it; the coordinator's timeline
                   event "prefill_finished")
prefill_done       pushkv: the coordinator received that report (the
                   connector's Submit, from its client thread)
ordered            pushkv: the coordinator ordered the WRITE (once both the
                   prefill report and the decode registration are in)
write_posted       pushkv: the coordinator received the POSTED report of the
                   last prefill rank (the WRITE was posted just before)
write_done         pushkv: the coordinator received the last rank's DONE report
kv_ready           pushkv: the coordinator received the decode agent's last
                   arrival report, sent as the agent emits KV_READY to its
                   worker (the decode rank knows its KV is ready)
decode_first_byte  the front (router or proxy) read the decode engine's first
                   streamed bytes: the first token has left the decode engine
client_first_byte  the client read the first streamed token (its TTFT)
prefill_response   the front read the prefill leg's answer: after the
                   forward, vLLM's output processing, its API server and HTTP.
                   On pull's path (the proxy waits for it); vLLM push and
                   pushkv send both legs at once, so for them it is only when
                   the prefill's answer came, not a step of the path.

A stage is the gap between consecutive boundaries of a path (signed: e.g. a
decode agent can count the notification before the coordinator hears the
WRITE's DONE). What vLLM's connectors do between the prefill's answer and the
decode's first token (the READ or WRITE, the decode side learning of it)
happens inside the engines, which log nothing per request: for them that whole
span is one stage. pushkv gets its own path and, for comparison, the front's
view that vLLM's connectors get. Everything but the fetch functions is pure.
"""

from __future__ import annotations

import itertools
import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Final

from pushkv.bench.serving.workload import ReqRecord
from pushkv.bench.stats import percentile

# (stage, unix seconds, rank or -1), as controlplane.timeline.Event
Event = tuple[str, float, int]
Quantiles = dict[str, float]  # {"p50": ms, "p99": ms, "n": samples}

PATH_PUSHKV: Final = (
    "sent",
    "prefill_finished",
    "prefill_done",
    "ordered",
    "write_posted",
    "write_done",
    "kv_ready",
    "decode_first_byte",
    "client_first_byte",
)
# An armed order (docs/architecture.md, "Armed orders"): the prefill worker
# fires the WRITE itself after its last forward; the prefill report and the
# coordinator's order are off this path.
PATH_ARMED: Final = (
    "sent",
    "write_posted",
    "write_done",
    "kv_ready",
    "decode_first_byte",
    "client_first_byte",
)
PATH_VLLM: Final = ("sent", "prefill_response", "decode_first_byte", "client_first_byte")
# After the prefill (pushkv, armed or not): from the engine finishing the
# request (request_finished's stamp, just after the WRITE of an armed order
# fired) to the decode engine's first bytes at the front.
PATH_POST: Final = ("prefill_finished", "decode_first_byte")
POST_STAGE: Final = "prefill_finished->decode_first_byte"
# The copy still to do when the prefill ends: from request_finished's stamp to
# the coordinator hearing the last rank's DONE (negative: the WRITE was done
# before; an upper bound on the copy itself, which ends before its report).
PATH_LEFT: Final = ("prefill_finished", "write_done")
LEFT_STAGE: Final = "prefill_finished->write_done"
TTFT_STAGE: Final = "sent->client_first_byte"
# Two boundaries measured as one span, not as a path to the first token.
SPANS: Final = (PATH_POST, PATH_LEFT)
# timeline stage -> boundary; per-rank stages take the last rank's
_FROM_TIMELINE: Final = {
    "prefill_finished": "prefill_finished",
    "prefill_done": "prefill_done",
    "ordered": "ordered",
    "write_posted": "write_posted",
    "write_done": "write_done",
    "arrived": "kv_ready",
    "armed": "armed",  # not a boundary: says which path the request took
}


def paths_of(system: str) -> tuple[tuple[str, ...], ...]:
    """The paths of boundaries observable for a system; () for one with no transfer."""
    if system == "pushkv":
        return (PATH_PUSHKV, PATH_ARMED, PATH_POST, PATH_LEFT, PATH_VLLM)
    if system == "pushkv-whole":
        return (PATH_PUSHKV, PATH_POST, PATH_LEFT, PATH_VLLM)
    if system.startswith(("pull", "vllm-push")):
        return (PATH_VLLM,)
    return ()


def stages_of(path: Sequence[str]) -> list[str]:
    """Consecutive stages of the path, then the whole (TTFT); a span's one stage."""
    if len(path) < 2:
        return []
    if path in SPANS:
        return [f"{path[0]}->{path[1]}"]
    return [f"{a}->{b}" for a, b in itertools.pairwise(path)] + [TTFT_STAGE]


def quantiles(xs: Sequence[float]) -> Quantiles:
    return {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "n": float(len(xs))}


def request_marks(
    rec: ReqRecord,
    front: Mapping[str, float] | None = None,
    timeline: Sequence[Event] = (),
) -> dict[str, float]:
    """One request's boundaries: the client's, its front's, its transfer's."""
    if rec.first_unix is None:
        return {}
    marks = {"sent": rec.sent_unix, "client_first_byte": rec.first_unix}
    for stage, at, _ in timeline:
        name = _FROM_TIMELINE.get(stage)
        if name is not None:
            marks[name] = max(marks.get(name, at), at)
    for name, at in (front or {}).items():
        marks.setdefault(name, at)
    return marks


def breakdown(marks: Sequence[Mapping[str, float]], path: Sequence[str]) -> dict[str, Quantiles]:
    """p50 / p99 (ms) of each stage of `path` over the requests that have both
    of its ends; a stage no request has is left out."""
    samples: dict[str, list[float]] = {s: [] for s in stages_of(path)}
    pairs = [*itertools.pairwise(path), (path[0], path[-1])] if len(path) > 1 else []
    if path in SPANS:
        pairs = [(path[0], path[1])]
    for m in marks:
        for (a, b), stage in zip(pairs, samples, strict=True):
            if a in m and b in m:
                samples[stage].append((m[b] - m[a]) * 1000)
    return {s: quantiles(xs) for s, xs in samples.items() if xs}


def response_key(rec: ReqRecord) -> str:
    """The id the front gave the request (vLLM answers X-Request-Id as "cmpl-<id>")."""
    return rec.response_id.removeprefix("cmpl-")


def critical_path(
    system: str,
    recs: Sequence[ReqRecord],
    front: Mapping[str, Mapping[str, float]],
    timelines: Mapping[str, Sequence[Event]],
) -> dict[str, Quantiles]:
    """The breakdown of a system's successful requests, over each of its paths."""
    paths = paths_of(system)
    if not paths:
        return {}
    marks = [
        request_marks(r, front.get(response_key(r)), timelines.get(response_key(r), ()))
        for r in recs
        if r.ok
    ]
    out: dict[str, Quantiles] = {}
    for path in paths:
        # An armed request's path is PATH_ARMED, another's PATH_PUSHKV; the
        # stages both share (from write_posted on) are the armed requests'.
        if path == PATH_ARMED:
            took = [m for m in marks if "armed" in m]
        elif path == PATH_PUSHKV and PATH_ARMED in paths:
            took = [m for m in marks if "armed" not in m]
        else:
            took = marks
        out.update(breakdown(took, path))
    return out


def text(stages: Mapping[str, Quantiles]) -> str:
    return ", ".join(f"{k} {v['p50']:.1f} / {v['p99']:.1f}" for k, v in stages.items())


# ------------------------------------------------------------------ fetching


def fetch_front_timings(base_url: str) -> dict[str, dict[str, float]]:
    """The front's GET /timings (pushkv/router/timings.py); {} on failure."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/timings", timeout=10) as r:
            got = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    if not isinstance(got, dict):
        return {}
    return {str(k): {str(n): float(t) for n, t in v.items()} for k, v in got.items()}


def fetch_timelines(coordinator: str) -> dict[str, list[Event]]:
    """transfer id -> its timeline, from the coordinator's ListTransfers; {} on failure."""
    import grpc

    from pushkv.v1 import pushkv_pb2 as pb
    from pushkv.v1 import pushkv_pb2_grpc as pbg

    channel = grpc.insecure_channel(coordinator)
    try:
        stub = pbg.StatusServiceStub(channel)
        listed = stub.ListTransfers(pb.ListTransfersRequest(limit=10_000), timeout=10)
    except grpc.RpcError:
        return {}
    finally:
        channel.close()
    return {
        t.transfer_id: [(e.stage, e.unix_us / 1e6, e.rank) for e in t.timeline]
        for t in listed.transfers
    }
