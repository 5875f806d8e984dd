"""`pushkv bench serving`: its command line, and the run from start to final line."""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from pushkv.bench.output import say
from pushkv.bench.serving import first_token
from pushkv.bench.serving.config import (
    ALL_SCENARIOS,
    CONTROLS,
    FIRST_TOKEN,
    HETERO_TP_CONTROLS,
    HETERO_TP_SYSTEMS,
    MIN_SPIN_MS,
    PREFILL_TPS,
    SCENARIOS,
    SYSTEMS,
    BenchConfig,
    topology,
)
from pushkv.bench.serving.linked import (
    LINK_STEP_TOKENS,
    check_args,
    linked_report,
    run_linked,
)
from pushkv.bench.serving.linked import (
    final_line as linked_final_line,
)
from pushkv.bench.serving.measure import run_system
from pushkv.bench.serving.proxy import proxy_main
from pushkv.bench.serving.report import final_line, highest_common_rate, plot, report
from pushkv.bench.serving.results import SystemRun
from pushkv.harness.netlink import LinkUnavailable, format_rate, parse_rate

DEFAULT_LINK = "1gbit"
# --quick --link: requests per rate at least (the run must fit in 15 minutes).
LINK_QUICK_REQUESTS = 16


def _setting(ap: argparse.ArgumentParser, kv: str) -> tuple[str, str]:
    key, sep, value = kv.partition("=")
    if not sep or not key:
        ap.error(f"--pushkv-setting wants KEY=VALUE, not {kv!r}")
    return key, value


def _parse(argv: Sequence[str] | None) -> tuple[BenchConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(
        prog="pushkv bench serving",
        description="pushkv vs vLLM NixlConnector (pull) vs vLLM NixlPushConnector vs one "
        "engine, on real vLLM servers (P core 0, D core 1).",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a <10 min run: nocache scenario only (with --scenario first-token: "
        f"{first_token.QUICK_REQUESTS} requests per system)",
    )
    ap.add_argument("--out", type=Path, help="write all raw figures to DIR/bench_serving.json")
    ap.add_argument(
        "--plot",
        type=Path,
        help="write the TTFT plot here (default: DIR/bench_ttft.png with --out, else in a "
        "new temporary directory; the run prints where). Nothing is written into the "
        "source tree unless named: --plot docs/bench_ttft.png refreshes the tracked figure",
    )
    ap.add_argument("--rates", type=str, help="comma-separated request rates (req/s)")
    ap.add_argument(
        "--systems", type=str, help=f"comma-separated, from {SYSTEMS + CONTROLS}; default {SYSTEMS}"
    )
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--scenarios", type=str, help=f"comma-separated subset of {SCENARIOS}")
    which.add_argument(
        "--scenario",
        choices=ALL_SCENARIOS,
        help=f"one scenario; {FIRST_TOKEN!r} runs alone: one streamed request at a time, "
        "pushkv against one engine, TTFT, time to the second token and decode handover "
        f"(its own defaults: {first_token.LAYERS} layers, hidden {first_token.HIDDEN}, "
        f"prompts {first_token.MIN_PROMPT}-{first_token.MAX_PROMPT}, "
        f"{first_token.OUTPUT_LEN} output tokens)",
    )
    ap.add_argument("--duration", type=float, help="seconds of arrivals per rate")
    ap.add_argument(
        "--min-requests", type=int, help="requests per rate at least (first-token: per system)"
    )
    # Shape and load defaults: the rate scenarios' here, first-token's in _defaults.
    ap.add_argument("--layers", type=int, help="default 4")
    ap.add_argument("--hidden", type=int, help="default 256")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, help="default 256")
    ap.add_argument("--max-prompt", type=int, help="default 3072")
    ap.add_argument("--output-len", type=int, help="default 64")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--timeout", type=float, help="per-request timeout (s)")
    ap.add_argument("--kv-lease", type=int, help="vLLM NIXL kv_lease_duration (default: vLLM's)")
    ap.add_argument(
        "--step-tokens",
        type=int,
        help="every engine's --max-num-batched-tokens: longer prompts are prefilled in "
        "chunks (pushkv pushes each chunk's blocks as it completes); default: whole prompts",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--pushkv-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a pushkv kv_connector_extra_config setting (repeatable), e.g. "
        "idle_wait_ms=0; default: the connector's own defaults, but thread_cpus=inherit "
        "(every system keeps the benchmark's core layout)",
    )
    ap.add_argument("--model-dir", type=Path, help="default .cache/bench-model-<shape>")
    ap.add_argument(
        "--pin",
        choices=("workers", "engines"),
        default="workers",
        help="core layout, the same for every system: bind only each engine's worker "
        "threads to its core (default), or every process of the engine (API server, "
        "EngineCore, worker)",
    )
    ap.add_argument(
        "--vllm-spin-ms",
        type=float,
        default=None,
        help="bound vLLM's shm message queues' busy-poll after each read to this many ms "
        f"(vLLM 0.32 hard-codes 1000), for every system alike, through a sitecustomize "
        f"shim; at least {MIN_SPIN_MS:g}. Default: vLLM's own. A diagnostic: a short "
        "poll gave requests 5 s stalls (vLLM's shm reader recheck; docs/benchmarks.md)",
    )
    ap.add_argument(
        "--kill-prefill-at",
        type=float,
        default=None,
        metavar="S",
        help="the fault scenario: kill -9 the prefill engine S seconds into the load "
        "(pushkv only, one rate) and report the success rate and the TTFT of requests "
        "after the kill (decode fallback) against those pushed before it",
    )
    ap.add_argument(
        "--prefill-tp",
        type=int,
        choices=PREFILL_TPS,
        default=1,
        help="tensor parallel size of the prefill engine; the decode engine stays TP1 "
        f"(heterogeneous TP). With 2: systems from {HETERO_TP_SYSTEMS} (default all "
        "three; single stays one TP1 engine), and the model's KV heads must divide by 2",
    )
    ap.add_argument(
        "--link",
        nargs="?",
        const=DEFAULT_LINK,
        default=None,
        metavar="RATE",
        help="also run the systems between two network namespaces joined by an emulated "
        f"link of RATE (default {DEFAULT_LINK}; needs root): a loopback phase at "
        "--low-rate (pushkv vs one engine), then pull (progress thread off), vLLM push, "
        "pushkv whole-request and pushkv armed+progressive over the link; every engine "
        f"gets --step-tokens (default {LINK_STEP_TOKENS} here). The final line holds issue "
        "19's five ratios (docs/benchmarks.md)",
    )
    ap.add_argument(
        "--low-rate",
        type=float,
        default=0.5,
        help="--link: the loopback phase's rate (req/s); default 0.5",
    )
    a = ap.parse_args(argv)
    if a.scenario:
        a.scenarios = a.scenario
    first = _defaults(ap, a)
    link_bit = _link_rate(ap, a)
    if a.vllm_spin_ms is not None and a.vllm_spin_ms < MIN_SPIN_MS:
        ap.error(f"--vllm-spin-ms must be at least {MIN_SPIN_MS:g}")
    if link_bit is not None and a.step_tokens is None:
        a.step_tokens = LINK_STEP_TOKENS
    least = max(a.max_num_seqs, a.block_size)
    if a.step_tokens is not None and a.step_tokens < least:
        # vLLM refuses a step budget under --max-num-seqs; under a block no
        # step could complete one.
        ap.error(f"--step-tokens must be at least {least} (--max-num-seqs and --block-size)")
    quick = bool(a.quick)
    rates = (
        tuple(float(x) for x in a.rates.split(","))
        if a.rates
        else ()
        if first  # one request at a time: no rate
        else _default_rates(quick, link=link_bit is not None)
    )
    default_systems = SYSTEMS if a.prefill_tp == 1 else HETERO_TP_SYSTEMS
    systems = tuple(a.systems.split(",")) if a.systems else default_systems
    scenarios = (
        tuple(a.scenarios.split(",")) if a.scenarios else (("nocache",) if quick else SCENARIOS)
    )
    for s in systems:
        if s not in SYSTEMS + CONTROLS:
            ap.error(f"unknown system {s!r}; known: {SYSTEMS + CONTROLS}")
    for s in scenarios:
        if s not in ALL_SCENARIOS:
            ap.error(f"unknown scenario {s!r}; known: {ALL_SCENARIOS}")
    if first:
        systems = first_token.SYSTEMS
    if a.kill_prefill_at is not None and (
        systems != ("pushkv",) or len(rates) != 1 or len(scenarios) != 1
    ):
        ap.error("--kill-prefill-at needs --systems pushkv, one --rates value and one scenario")
    if a.prefill_tp > 1:
        _check_prefill_tp(ap, a, systems)
    max_pos = 1 << math.ceil(math.log2(a.max_prompt + a.output_len + 1))
    model_dir = a.model_dir or Path(f".cache/bench-model-l{a.layers}-h{a.hidden}-p{max_pos}")
    cfg = BenchConfig(
        model_dir=model_dir,
        layers=a.layers,
        hidden=a.hidden,
        block_size=a.block_size,
        min_prompt=a.min_prompt,
        max_prompt=a.max_prompt,
        output_len=a.output_len,
        rates=rates,
        duration_s=a.duration if a.duration is not None else (15.0 if quick else 20.0),
        min_requests=a.min_requests
        if a.min_requests is not None
        else _default_requests(quick, link=link_bit is not None, first=first),
        timeout_s=a.timeout if a.timeout is not None else (60.0 if quick else 120.0),
        max_num_seqs=a.max_num_seqs,
        kvcache_gib=1 if first else BenchConfig.kvcache_gib,  # first-token: 3 engines up at once
        seed=a.seed,
        kv_lease_s=a.kv_lease,
        pushkv_extra=tuple(_setting(ap, kv) for kv in a.pushkv_setting),
        systems=systems,
        scenarios=scenarios,
        quick=quick,
        startup_timeout_s=150.0 if quick else 300.0,
        pin=a.pin,
        vllm_spin_ms=a.vllm_spin_ms,
        kill_prefill_at_s=a.kill_prefill_at,
        prefill_tp=a.prefill_tp,
        step_tokens=a.step_tokens,
        link_rate_bit=link_bit,
        low_rate=a.low_rate,
    )
    return cfg, a


def _defaults(ap: argparse.ArgumentParser, a: argparse.Namespace) -> bool:
    """Fill the shape and load settings not given: first-token's own, or the rate
    scenarios'; whether the run is the first-token scenario (which runs alone)."""
    named = (a.scenarios or "").split(",")
    first = FIRST_TOKEN in named
    if first:
        if len(named) > 1:
            ap.error(f"{FIRST_TOKEN!r} runs alone: its own model, systems and load")
        given = {
            "--systems": a.systems,
            "--rates": a.rates,
            "--duration": a.duration,
            "--link": a.link,
            "--kill-prefill-at": a.kill_prefill_at,
            "--prefill-tp 2": a.prefill_tp != 1,
        }
        for flag, value in given.items():
            if value:
                ap.error(
                    f"--scenario {FIRST_TOKEN} runs pushkv against one engine, "
                    f"one request at a time: it takes no {flag}"
                )
        if a.min_requests is not None and a.min_requests < 2:
            ap.error(f"--scenario {FIRST_TOKEN} needs --min-requests of at least 2")
        if a.output_len is not None and a.output_len < 2:
            ap.error(f"--scenario {FIRST_TOKEN} needs --output-len of at least 2")
    shape = (
        (
            first_token.LAYERS,
            first_token.HIDDEN,
            first_token.MIN_PROMPT,
            first_token.MAX_PROMPT,
            first_token.OUTPUT_LEN,
        )
        if first
        else (4, 256, 256, 3072, 64)
    )
    for name, value in zip(
        ("layers", "hidden", "min_prompt", "max_prompt", "output_len"), shape, strict=True
    ):
        if getattr(a, name) is None:
            setattr(a, name, value)
    if not 0 < a.min_prompt <= a.max_prompt:
        ap.error(f"prompts {a.min_prompt}-{a.max_prompt}: want 0 < --min-prompt <= --max-prompt")
    return first


def _default_requests(quick: bool, *, link: bool, first: bool) -> int:
    if first:
        return first_token.QUICK_REQUESTS if quick else first_token.FULL_REQUESTS
    return LINK_QUICK_REQUESTS if quick and link else 30


def _default_rates(quick: bool, *, link: bool) -> tuple[float, ...]:
    if link:  # the link phase's; the loopback phase runs --low-rate
        return (0.5, 1.0) if quick else (0.5, 1.0, 1.5, 2.0)
    return (1.0, 2.0) if quick else (0.5, 1.0, 1.5, 2.0, 3.0)


def _link_rate(ap: argparse.ArgumentParser, a: argparse.Namespace) -> int | None:
    """--link's rate in bit/s (None without --link); refuses what --link cannot take."""
    if a.link is None:
        return None
    why = check_args(
        a.systems,
        scenarios=a.scenarios,
        kill_prefill_at=a.kill_prefill_at is not None,
        prefill_tp=a.prefill_tp != 1,
    )
    if why:
        ap.error(why)
    if a.low_rate <= 0:
        ap.error("--low-rate must be positive")
    try:
        return parse_rate(a.link)
    except ValueError as exc:
        ap.error(f"--link: {exc}")


def _check_prefill_tp(
    ap: argparse.ArgumentParser, a: argparse.Namespace, systems: tuple[str, ...]
) -> None:
    """What a TP2 prefill engine needs: a connector that takes it, KV heads that
    split across its ranks, and both cores free for its workers."""
    from pushkv.harness.tiny_model import model_params

    tp = a.prefill_tp
    takes = HETERO_TP_SYSTEMS + HETERO_TP_CONTROLS
    other = [s for s in systems if s not in takes]
    if other:
        ap.error(f"--prefill-tp {tp} runs only {takes}, not {other}")
    try:
        kv_heads = int(model_params(layers=a.layers, hidden=a.hidden)["num_key_value_heads"])
    except ValueError as exc:
        ap.error(str(exc))
    if kv_heads % tp:
        ap.error(f"--prefill-tp {tp}: the model's {kv_heads} KV heads do not divide by {tp}")
    if a.pin == "engines":
        ap.error(f"--prefill-tp {tp} binds the prefill workers to both cores: use --pin workers")
    if a.kill_prefill_at is not None:
        ap.error("--kill-prefill-at is measured with a TP1 prefill engine only")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "proxy":
        return proxy_main(args[1:])
    cfg, a = _parse(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: blocks
    t0 = time.monotonic()
    from pushkv.harness.tiny_model import build_tiny_model

    max_pos = 1 << math.ceil(math.log2(cfg.max_model_len))
    build_tiny_model(cfg.model_dir, layers=cfg.layers, hidden=cfg.hidden, max_positions=max_pos)
    if cfg.scenarios == (FIRST_TOKEN,):
        return first_token.main_first_token(cfg, a.out, t0)
    say(
        f"topology: {topology(cfg.prefill_tp)}; "
        f"core layout: --pin {cfg.pin}; vLLM shm queue busy-poll: "
        + (
            f"{cfg.vllm_spin_ms:g} ms (--vllm-spin-ms), every system"
            if cfg.vllm_spin_ms is not None
            else "vLLM's own (1 s)"
        )
        + "; "
        f"model {cfg.model_dir}: Llama {cfg.layers} layers, hidden {cfg.hidden}, fp32, block "
        f"{cfg.block_size}; prompts {cfg.min_prompt}-{cfg.max_prompt} tokens, "
        f"{cfg.output_len} output tokens; "
        + (
            f"rates {cfg.rates}; systems {cfg.systems}; scenarios {cfg.scenarios}"
            if cfg.link_rate_bit is None
            else f"--link {format_rate(cfg.link_rate_bit)}: two phases (below); "
            f"step budget {cfg.step_tokens} tokens for every engine"
        )
    )
    if cfg.link_rate_bit is not None:
        return _main_linked(cfg, a, t0)
    all_runs: dict[str, dict[str, SystemRun]] = {}
    for scenario in cfg.scenarios:
        all_runs[scenario] = {}
        for system in cfg.systems:
            all_runs[scenario][system] = run_system(cfg, system, scenario)
    lines = report(cfg, all_runs)
    for line in lines:
        say(line)
    primary = all_runs.get("nocache") or next(iter(all_runs.values()))
    last, best = final_line(cfg, primary)
    try:
        where = plot_path(a.plot, a.out)
        plot(cfg, all_runs, where)
        say(f"plot: {where}")
    except Exception as exc:  # a missing matplotlib must not lose the figures
        say(f"plot not written: {type(exc).__name__}: {exc}")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        dump = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
            "wall_s": round(time.monotonic() - t0, 1),
            "comparison_rate": best,
            "final_line": last,
            "runs": {
                sc: {sy: asdict(r) for sy, r in runs.items()} for sc, runs in all_runs.items()
            },
        }
        path = a.out / "bench_serving.json"
        path.write_text(json.dumps(dump, indent=1, default=str))
        say(f"raw figures: {path}")
    primary_name = "nocache" if "nocache" in all_runs else next(iter(all_runs))
    if highest_common_rate(primary, cfg.rates) is None:
        primary_name += "; no rate was sustained by all compared systems: lowest rate used"
    say(f"wall time {time.monotonic() - t0:.0f} s; ratios taken at {best} req/s ({primary_name})")
    say(last)
    return 0


def plot_path(plot: Path | None, out: Path | None) -> Path:
    """Where the TTFT plot goes: `--plot`, else `--out`'s folder, else a new
    temporary directory; never into the source tree unless named."""
    if plot is not None:
        return plot
    if out is not None:
        return out / "bench_ttft.png"
    return Path(tempfile.mkdtemp(prefix="pushkv-bench-serving-")) / "bench_ttft.png"


def _main_linked(cfg: BenchConfig, a: argparse.Namespace, t0: float) -> int:
    """--link: both phases, their report, the goals' final line (no plot)."""
    try:
        res = run_linked(cfg)
    except LinkUnavailable as exc:
        say(f"--link: the emulated link cannot be set up here: {exc}")
        return 2
    for line in linked_report(cfg, res):
        say(line)
    last = linked_final_line(res)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        dump = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
            "link": format_rate(cfg.link_rate_bit or 0),
            "wall_s": round(time.monotonic() - t0, 1),
            "link_comparison_rate": res.link_rate,
            "final_line": last,
            "loopback": {sy: asdict(r) for sy, r in res.loop.items()},
            "linked": {sy: asdict(r) for sy, r in res.link.items()},
        }
        path = a.out / "bench_serving.json"
        path.write_text(json.dumps(dump, indent=1, default=str))
        say(f"raw figures: {path}")
    say(f"wall time {time.monotonic() - t0:.0f} s")
    say(last)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
