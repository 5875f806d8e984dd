"""The first-token scenario (``--scenario first-token``): how soon the first two
tokens come, pushkv against one engine with no connector, one request at a time.

Both systems are up at once: pushkv (prefill engine on core 0, decode engine on
core 1, coordinator, ``pushkv router --first-token prefill``; its default
router, ``--first-token decode``, runs beside as "pushkv-decode-first") and a
single engine on core 0, the
prefill engine's core. The same prompts go to both, one streamed request at a
time, alternating: pair ``i`` sends prompt ``i`` to both systems, pushkv first
in even pairs and the single engine first in odd ones, so the machine's noise
and any drift hit both alike. Before each request every engine is left idle
longer than vLLM's workers busy-poll after their last message (1 s), so a
request never runs beside the other system's spinning workers.

Per request, at the client: TTFT (the first streamed token), TTST (the second
token: the second event, or the first if it carried two or more tokens;
``workload.event_tokens``) and, for pushkv, the decode handover from the
router's ``GET /timings`` (pushkv/router/timings.py): the decode engine's first
bytes at the router minus the prefill leg's answer at the router. That holds
for either router: one that answers the first token from the decode engine,
and one that answers it from the prefill engine's answer, the decode engine
continuing from the second token.

Everything but :func:`run_first_token` and :func:`main_first_token` is pure.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final

import aiohttp

from pushkv.bench.output import say, table_head, table_row
from pushkv.bench.serving.config import FIRST_TOKEN, SCENARIO_LABELS, BenchConfig
from pushkv.bench.serving.critpath import Quantiles, fetch_front_timings, quantiles, response_key
from pushkv.bench.serving.deployment import Deployment
from pushkv.bench.serving.measure import start_deployment
from pushkv.bench.serving.results import SystemRun
from pushkv.bench.serving.workload import ReqRecord, completion_body, stream_one
from pushkv.harness.vllm_server import RouterProcess
from pushkv.router.timings import DECODE_FIRST_BYTE, PREFILL_RESPONSE

SYSTEMS: Final = ("pushkv", "single")  # the ratios are the first over the second
# pushkv's deployment behind its default router (`--first-token decode`: both
# legs at once, the decode engine answers every token), beside the router
# with `--first-token prefill` that "pushkv" names here, in the same run.
CONTROL: Final = "pushkv-decode-first"
ALL: Final = (*SYSTEMS, CONTROL)
QUICK_REQUESTS: Final = 40  # per system
FULL_REQUESTS: Final = 100
# Its own shape (a 2-layer, hidden-128 Llama: the tiny test model) and load.
LAYERS: Final = 2
HIDDEN: Final = 128
MIN_PROMPT: Final = 128
MAX_PROMPT: Final = 1024
OUTPUT_LEN: Final = 8
# vLLM's workers busy-poll their shm queue for 1 s after each message (vLLM's
# own window, unless --vllm-spin-ms): each request waits that long, and a margin,
# after the previous one ended.
VLLM_SPIN_S: Final = 1.0
SETTLE_MARGIN_S: Final = 0.3
WARMUP_PER_SYSTEM: Final = 4
# A /timings entry belongs to a request whose id it does not carry if its marks
# fall between the request's send and its last token plus this. The run passes
# its idle gap: the next request's marks all come after it.
MATCH_SLACK_S: Final = 1.0
TIMINGS_WAIT_S: Final = 10.0  # for the router's last marks


def settle_s(cfg: BenchConfig) -> float:
    spin = VLLM_SPIN_S if cfg.vllm_spin_ms is None else cfg.vllm_spin_ms / 1000
    return spin + SETTLE_MARGIN_S


def ladder(cfg: BenchConfig, n: int) -> list[tuple[int, ...]]:
    """``n`` random-token prompts whose lengths step evenly from the shortest to
    the longest, in a seeded shuffled order."""
    if n < 2:
        raise ValueError(f"the first-token scenario needs at least 2 requests, got {n}")
    if not 0 < cfg.min_prompt <= cfg.max_prompt:
        raise ValueError(f"bad prompt range {cfg.min_prompt}-{cfg.max_prompt}")
    rng = random.Random(f"{cfg.seed}/{FIRST_TOKEN}")
    span = cfg.max_prompt - cfg.min_prompt
    lengths = [cfg.min_prompt + round(i * span / (n - 1)) for i in range(n)]
    rng.shuffle(lengths)
    return [tuple(rng.randrange(4, 1024) for _ in range(length)) for length in lengths]


def schedule(n: int, systems: Sequence[str] = SYSTEMS) -> list[tuple[int, str]]:
    """(prompt index, system) in sending order: every prompt to every system, the
    order within a pair flipped from one pair to the next."""
    order: list[tuple[int, str]] = []
    for i in range(n):
        turn = systems if i % 2 == 0 else tuple(reversed(systems))
        order += [(i, s) for s in turn]
    return order


# ------------------------------------------------------------------ summary


def handovers_ms(
    recs: Sequence[ReqRecord],
    front: Mapping[str, Mapping[str, float]],
    slack_s: float = MATCH_SLACK_S,
) -> tuple[list[float], int]:
    """(each successful request's decode handover in ms, how many had none).

    Handover: ``decode_first_byte - prefill_response``, the router's marks for
    the request (signed: the decode engine can answer before the prefill leg's
    answer is read). A request is found by its response id (``cmpl-<transfer
    id>``) or else by time: the one entry with both marks between its send and
    its last token (plus ``slack_s``); several such entries: none.
    """
    complete = {
        k: (m[PREFILL_RESPONSE], m[DECODE_FIRST_BYTE])
        for k, m in front.items()
        if PREFILL_RESPONSE in m and DECODE_FIRST_BYTE in m
    }
    out: list[float] = []
    missing = 0
    for r in recs:
        if not r.ok:
            continue
        pair = complete.get(response_key(r))
        end = r.end_unix
        if pair is None and end is not None:
            near = [
                p for p in complete.values() if all(r.sent_unix <= t <= end + slack_s for t in p)
            ]
            pair = near[0] if len(near) == 1 else None
        if pair is None:
            missing += 1
        else:
            out.append((pair[1] - pair[0]) * 1000)
    return out, missing


@dataclass(frozen=True)
class SystemFigures:
    n: int
    ok: int
    ttft_ms: Quantiles
    ttst_ms: Quantiles
    gap_ms: Quantiles  # TTST - TTFT, per request
    multi_first: int  # requests whose first event carried two or more tokens
    errors: tuple[str, ...] = ()


def figures(recs: Sequence[ReqRecord]) -> SystemFigures:
    ok = [r for r in recs if r.ok]
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    ttst = [r.ttst * 1000 for r in ok if r.ttst is not None]
    gap = [(r.ttst - r.ttft) * 1000 for r in ok if r.ttst is not None and r.ttft is not None]
    return SystemFigures(
        n=len(recs),
        ok=len(ok),
        ttft_ms=quantiles(ttft),
        ttst_ms=quantiles(ttst),
        gap_ms=quantiles(gap),
        multi_first=sum(1 for r in ok if r.first_event_tokens >= 2),
        errors=tuple(sorted({r.error or "timed out" for r in recs if not r.ok})[:5]),
    )


def _ratio(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) or b == 0 else a / b


@dataclass(frozen=True)
class Summary:
    systems: dict[str, SystemFigures]
    handover_ms: Quantiles
    handover_missing: int
    # pushkv / single: "ttft_p50", "ttft_p99", "ttst_p50", "ttst_p99"
    ratios: dict[str, float] = field(default_factory=dict)


def summarize(
    records: Mapping[str, Sequence[ReqRecord]],
    handover_ms: Sequence[float],
    handover_missing: int = 0,
) -> Summary:
    """Per-system figures and the ratios of the first of :data:`SYSTEMS` over the
    second (nan where either has no sample)."""
    figs = {s: figures(recs) for s, recs in records.items()}
    a, b = (figs.get(s) for s in SYSTEMS)
    ratios: dict[str, float] = {}
    for metric in ("ttft", "ttst"):
        for q in ("p50", "p99"):
            x = math.nan if a is None else getattr(a, f"{metric}_ms")[q]
            y = math.nan if b is None else getattr(b, f"{metric}_ms")[q]
            ratios[f"{metric}_{q}"] = _ratio(x, y)
            c = figs.get(CONTROL)
            z = math.nan if c is None else getattr(c, f"{metric}_ms")[q]
            ratios[f"control_{metric}_{q}"] = _ratio(z, y)
    return Summary(figs, quantiles(handover_ms), handover_missing, ratios)


def _f(x: float, digits: int) -> str:
    return "nan" if math.isnan(x) else f"{x:.{digits}f}"


def final_line(summary: Summary) -> str:
    """The scenario's last line."""
    return (
        f"ttft_p50_ratio_vs_single={_f(summary.ratios['ttft_p50'], 3)} "
        f"ttst_p50_ratio_vs_single={_f(summary.ratios['ttst_p50'], 3)} "
        f"handover_p50_ms={_f(summary.handover_ms['p50'], 2)}"
    )


def _pq(q: Quantiles, digits: int = 1) -> str:
    return f"{_f(q['p50'], digits)} / {_f(q['p99'], digits)}"


def report_lines(
    cfg: BenchConfig, summary: Summary, failed: Mapping[str, str] | None = None
) -> list[str]:
    lines = [
        "",
        f"## scenario {FIRST_TOKEN}: {SCENARIO_LABELS[FIRST_TOKEN]}",
        f"model: Llama {cfg.layers} layers, hidden {cfg.hidden}, fp32; prompts "
        f"{cfg.min_prompt}-{cfg.max_prompt} tokens (a shuffled ladder), {cfg.output_len} "
        f"output tokens (ignore_eos); pushkv: prefill core 0, decode core 1; single "
        f"engine: core 0; requests alternate, {settle_s(cfg):.1f} s idle before each",
        *table_head(
            "system",
            "ok/n",
            "TTFT p50 / p99 (ms)",
            "TTST p50 / p99 (ms)",
            "TTST - TTFT p50 / p99 (ms)",
            "first event with 2+ tokens",
        ),
    ]
    for system in ALL:
        why = (failed or {}).get(system)
        fig = summary.systems.get(system)
        if system == CONTROL and not why and fig is None:
            continue  # not run
        if why or fig is None:
            lines.append(f"| {system} | FAILED: {why or 'not run'} |||||")
            continue
        lines.append(
            table_row(
                system,
                f"{fig.ok}/{fig.n}",
                _pq(fig.ttft_ms),
                _pq(fig.ttst_ms),
                _pq(fig.gap_ms),
                fig.multi_first,
            )
        )
        if fig.errors:
            lines.append(f"  {system} errors: {list(fig.errors)}")
    r = summary.ratios
    h = summary.handover_ms
    lines += [
        f"pushkv / single: TTFT p50 {_f(r['ttft_p50'], 2)}, p99 {_f(r['ttft_p99'], 2)}; "
        f"TTST p50 {_f(r['ttst_p50'], 2)}, p99 {_f(r['ttst_p99'], 2)}",
        f"{CONTROL} / single (the same engines behind the default router, "
        "--first-token decode): "
        f"TTFT p50 {_f(r.get('control_ttft_p50', math.nan), 2)}, "
        f"TTST p50 {_f(r.get('control_ttst_p50', math.nan), 2)}",
        "pushkv decode handover (router /timings: decode_first_byte - prefill_response), "
        f"p50 / p99: {_pq(h, 2)} ms over {int(h['n'])} requests"
        + (
            f" ({summary.handover_missing} not found in /timings)"
            if summary.handover_missing
            else ""
        ),
    ]
    return lines


# ---------------------------------------------------------------------- run


@dataclass
class FirstTokenRun:
    records: dict[str, list[ReqRecord]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # system -> why it did not run
    startup_s: dict[str, float] = field(default_factory=dict)
    handover_ms: list[float] = field(default_factory=list)
    handover_missing: int = 0
    front_timings: dict[str, dict[str, float]] = field(default_factory=dict)  # the router's


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    prompt: Sequence[int],
    cfg: BenchConfig,
    t0: float,
) -> ReqRecord:
    """One streamed request; its times in seconds after ``t0`` (perf_counter)."""
    body = completion_body(prompt, cfg.output_len, stream=True)
    rec = ReqRecord(0, len(prompt), time.perf_counter() - t0)
    await stream_one(session, url, rec, body, t0, cfg.timeout_s, expect_tokens=cfg.output_len)
    return rec


async def _sequence(
    cfg: BenchConfig, urls: Mapping[str, str], prompts: Sequence[Sequence[int]]
) -> tuple[dict[str, list[ReqRecord]], dict[str, str]]:
    """Warm each system up, then send the schedule one request at a time; the
    records, and a system whose warm-up failed (none: {})."""
    out: dict[str, list[ReqRecord]] = {s: [] for s in urls}
    settle = settle_s(cfg)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        warm = [cfg.min_prompt, (cfg.min_prompt + cfg.max_prompt) // 2, cfg.max_prompt]
        rng = random.Random(f"{cfg.seed}/{FIRST_TOKEN}/warmup")
        for k in range(WARMUP_PER_SYSTEM):
            length = warm[k % len(warm)]
            prompt = [rng.randrange(4, 1024) for _ in range(length)]
            for system, url in urls.items():
                rec = await _send(session, url, prompt, cfg, t0)
                if not rec.ok:
                    return out, {system: f"warm-up failed: {rec.error or 'timed out'}"}
        order = schedule(len(prompts), tuple(s for s in ALL if s in urls))
        for done, (i, system) in enumerate(order, 1):
            await asyncio.sleep(settle)  # the other system's workers stop spinning
            rec = await _send(session, urls[system], prompts[i], cfg, t0)
            rec.index = i
            out[system].append(rec)
            if done % 20 == 0 or done == len(order):
                say(f"  {done}/{len(order)} requests sent")
    return out, {}


def _read_handovers(
    front_url: str, recs: Sequence[ReqRecord], slack_s: float
) -> tuple[list[float], int, dict[str, dict[str, float]]]:
    """The handovers from the router's /timings, read again (bounded) while one is
    missing: the prefill leg's answer can reach the router after the decode
    engine's last token, so the last request's mark may not be there yet."""
    deadline = time.monotonic() + TIMINGS_WAIT_S
    while True:
        front = fetch_front_timings(front_url)
        got, missing = handovers_ms(recs, front, slack_s)
        if not missing or time.monotonic() > deadline:
            return got, missing, front
        time.sleep(0.2)


def run_first_token(cfg: BenchConfig) -> FirstTokenRun:
    """Deploy both systems, send the scenario's requests, read pushkv's handovers."""
    res = FirstTokenRun()
    prompts = ladder(cfg, cfg.min_requests)
    deps: dict[str, Deployment] = {}
    try:
        for system in SYSTEMS:
            t0 = time.monotonic()
            say(f"[{FIRST_TOKEN}] {system}: starting ...")
            run = SystemRun(system, FIRST_TOKEN)
            dep = start_deployment(cfg, run)
            if dep is None:
                res.failed[system] = run.error
                continue
            deps[system] = dep
            res.startup_s[system] = round(time.monotonic() - t0, 1)
            say(f"[{FIRST_TOKEN}] {system}: up in {res.startup_s[system]:.0f} s")
        if not deps:
            return res
        urls = {s: d.front_url.rstrip("/") + "/v1/completions" for s, d in deps.items()}
        seeded_url = ""
        if "pushkv" in deps:
            # pushkv: a router with --first-token prefill on the deployment's
            # engines; the deployment's own router (both legs at once) is the control.
            seeded = RouterProcess(deps["pushkv"].coordinator, flags=("--first-token", "prefill"))
            deps["pushkv"].helpers.append(seeded)
            seeded.start(timeout=120)
            seeded_url = seeded.url
            urls[CONTROL] = urls["pushkv"]
            urls["pushkv"] = seeded.url + "/v1/completions"
        res.records, warm_failed = asyncio.run(_sequence(cfg, urls, prompts))
        if warm_failed:
            for system, why in warm_failed.items():
                say(f"[{FIRST_TOKEN}] {system}: {why}")
            res.failed.update(warm_failed)
            return res
        if "pushkv" in deps:
            res.handover_ms, res.handover_missing, res.front_timings = _read_handovers(
                seeded_url, res.records["pushkv"], settle_s(cfg)
            )
        return res
    finally:
        for dep in deps.values():
            dep.stop()


def main_first_token(cfg: BenchConfig, out: Path | None, t0: float) -> int:
    """The scenario from start to its last line."""
    say(
        f"[{FIRST_TOKEN}] {cfg.min_requests} requests per system ({', '.join(ALL)}), "
        f"one at a time; model {cfg.model_dir}"
    )
    res = run_first_token(cfg)
    summary = summarize(res.records, res.handover_ms, res.handover_missing)
    for line in report_lines(cfg, summary, res.failed):
        say(line)
    last = final_line(summary)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        dump = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
            "wall_s": round(time.monotonic() - t0, 1),
            "final_line": last,
            "startup_s": res.startup_s,
            "failed": res.failed,
            "summary": asdict(summary),
            "handover_ms": res.handover_ms,
            "front_timings": res.front_timings,
            "records": {s: [asdict(r) for r in recs] for s, recs in res.records.items()},
        }
        path = out / "bench_first_token.json"
        path.write_text(json.dumps(dump, indent=1, default=str))
        say(f"raw figures: {path}")
    say(f"wall time {time.monotonic() - t0:.0f} s")
    say(last)
    return 0 if not res.failed else 1
