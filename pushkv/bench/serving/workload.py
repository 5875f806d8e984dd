"""The serving benchmark's load: prompts, Poisson arrivals, and the streaming client.

Every system gets the same prompts at the same arrival times (seeded per
scenario and rate). The client streams each completion, so TTFT is the time to
the first streamed token, TTST the time to the second and TPOT is
(last - first) / (n - 1).

How vLLM streams: one SSE event per engine output, but its API server merges
the outputs a slow consumer has not taken yet (``RequestOutputCollector``), so
one event can carry several tokens. Every request asks for
``continuous_usage_stats``: each event then carries the cumulative completion
tokens, and the client counts tokens, not events (:func:`event_tokens`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from pushkv.bench.serving.config import BenchConfig


@dataclass(frozen=True)
class Workload:
    rate: float
    prompts: tuple[tuple[int, ...], ...]
    arrivals: tuple[float, ...]  # seconds after the start of the run


def make_workload(cfg: BenchConfig, scenario: str, rate_index: int, rate: float) -> Workload:
    """Prompts and Poisson arrivals; identical for every system (seeded per scenario/rate)."""
    rng = random.Random(f"{cfg.seed}/{scenario}/{rate_index}/{rate}")
    n = cfg.requests_for(rate)
    prompts = []
    for _ in range(n):
        length = rng.randint(cfg.min_prompt, cfg.max_prompt)
        prompts.append(tuple(rng.randrange(4, 1024) for _ in range(length)))
    # Exponential gaps (Poisson arrivals), rescaled so that the n arrivals span exactly
    # (n - 1) / rate: short runs then offer the nominal rate, not a random one.
    gaps = [rng.expovariate(rate) for _ in range(n - 1)]
    scale = (n - 1) / rate / sum(gaps) if gaps else 1.0
    arrivals, t = [0.0], 0.0
    for g in gaps:
        t += g * scale
        arrivals.append(t)
    return Workload(rate, tuple(prompts), tuple(arrivals))


def warmup_workload(cfg: BenchConfig) -> Workload:
    """A few short prompts, all at once: handshakes and first-request costs, not measured."""
    rng = random.Random(f"{cfg.seed}/warmup")
    prompts = [
        [rng.randrange(4, 1024) for _ in range(rng.randint(cfg.min_prompt, cfg.min_prompt * 2))]
        for _ in range(cfg.warmup_requests)
    ]
    return Workload(0.0, tuple(tuple(p) for p in prompts), tuple(0.0 for _ in prompts))


@dataclass
class ReqRecord:
    index: int
    prompt_len: int
    sent: float  # seconds after the start of the run
    first: float | None = None
    second: float | None = None  # when the second token arrived (the first's event, if it had 2+)
    last: float | None = None
    tokens: int = 0
    chunks: int = 0
    error: str = ""
    timed_out: bool = False
    sent_unix: float = 0.0
    first_unix: float | None = None
    response_id: str = ""  # the router's transfer id shows here as "cmpl-<transfer id>"
    first_event_tokens: int = 0  # tokens the first streamed event carried

    @property
    def end_unix(self) -> float | None:
        """When the last token arrived, on the unix clock."""
        return None if self.last is None else self.sent_unix + (self.last - self.sent)

    @property
    def ok(self) -> bool:
        return not self.error and not self.timed_out and self.first is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def ttst(self) -> float | None:
        return None if self.second is None else self.second - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


def completion_body(prompt: Sequence[int], max_tokens: int, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        # Each event's cumulative completion tokens: an event may carry several.
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def event_tokens(chunk: dict[str, Any], usage_before: int) -> tuple[int, int]:
    """(tokens a streamed event with choices carries, the cumulative usage after it).

    Its choice's ``token_ids`` if listed, else the growth of the cumulative
    ``usage.completion_tokens``, else one. At least one: vLLM sends no event
    without a token. A front that writes an event of its own (no usage) before
    relaying an engine's stream keeps the count right: the engine's usage then
    grows from where that event left it.
    """
    usage = chunk.get("usage") or {}
    now = usage.get("completion_tokens")
    after = int(now) if isinstance(now, int) else usage_before
    choice = chunk["choices"][0] if chunk.get("choices") else {}
    ids = choice.get("token_ids") if isinstance(choice, dict) else None
    if isinstance(ids, list):
        return max(1, len(ids)), after
    return max(1, after - usage_before), after


async def stream_one(
    session: aiohttp.ClientSession,
    url: str,
    rec: ReqRecord,
    body: dict[str, Any],
    t0: float,
    timeout_s: float,
    expect_tokens: int,
) -> None:
    rec.sent_unix = time.time()
    try:
        async with asyncio.timeout(timeout_s), session.post(url, json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            done = False
            counted = usage_seen = 0
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {str(chunk['error'])[:200]}"
                    return
                if chunk.get("choices"):
                    now = time.perf_counter() - t0
                    n, usage_seen = event_tokens(chunk, usage_seen)
                    if rec.first is None:
                        rec.first = now
                        rec.first_unix = time.time()
                        rec.response_id = str(chunk.get("id", ""))
                        rec.first_event_tokens = n
                    counted += n
                    if rec.second is None and counted >= 2:
                        rec.second = now
                    rec.last = now
                    rec.chunks += 1
                usage = chunk.get("usage")
                if usage:
                    rec.tokens = int(usage.get("completion_tokens") or 0)
            if not rec.tokens:
                rec.tokens = rec.chunks
            if not done:
                rec.error = "stream ended without [DONE]"
            elif rec.tokens != expect_tokens:
                rec.error = f"got {rec.tokens} tokens, expected {expect_tokens}"
    except TimeoutError:
        rec.timed_out = True
    except (aiohttp.ClientError, ValueError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]


async def _run_load(url: str, wl: Workload, output_len: int, timeout_s: float) -> list[ReqRecord]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    records = [ReqRecord(i, len(p), wl.arrivals[i]) for i, p in enumerate(wl.prompts)]
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        tasks = []
        for rec, prompt in zip(records, wl.prompts, strict=True):
            delay = t0 + rec.sent - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec.sent = time.perf_counter() - t0
            body = completion_body(prompt, output_len, stream=True)
            tasks.append(
                asyncio.create_task(
                    stream_one(session, url, rec, body, t0, timeout_s, expect_tokens=output_len)
                )
            )
        await asyncio.gather(*tasks)
    return records


def run_load(base_url: str, wl: Workload, output_len: int, timeout_s: float) -> list[ReqRecord]:
    """Send the workload's requests at its arrival times, streamed; one record each."""
    url = base_url.rstrip("/") + "/v1/completions"
    return asyncio.run(_run_load(url, wl, output_len, timeout_s))


async def _post_many(
    url: str, prompts: Sequence[Sequence[int]], concurrency: int, timeout_s: float
) -> list[str]:
    """Non-streamed one-token completions; returns an error string per failed prompt."""
    sem = asyncio.Semaphore(concurrency)
    errors: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:

        async def one(p: Sequence[int]) -> None:
            async with sem:
                try:
                    async with s.post(url, json=completion_body(p, 1, stream=False)) as r:
                        if r.status != 200:
                            errors.append(f"HTTP {r.status}: {(await r.text())[:200]}")
                        else:
                            await r.read()
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])

        await asyncio.gather(*(one(p) for p in prompts))
    return errors


def warm_prefix_cache(url: str, prompts: Sequence[Sequence[int]], timeout_s: float) -> list[str]:
    """Prefill ``prompts`` on one engine (two at a time), so its prefix cache holds them."""
    return asyncio.run(_post_many(url + "/v1/completions", prompts, 2, timeout_s))
