"""`pushkv bench serving --link`: the loopback low-load comparison and the
emulated two-node comparison, in one run, and the final line of issue 19's goals.

Two phases, each system deployed, warmed up and loaded as in any serving run
(pushkv/bench/serving/measure.py):

1. **Loopback, low load** (`--low-rate`, default 0.5 req/s): pushkv (armed
   orders, progressive push) and a single engine with no disaggregation, all
   on this host. Gives the post-prefill path against its limit (one decode
   step plus the copy still to do when the prefill ends) and TTFT against the
   single engine.
2. **The emulated link** (pushkv/harness/netlink.py): the prefill engine in network
   namespace A, the decode engine in B, their KV over UCX's TCP transport on a
   veth pair capped by tc's tbf at `--link`'s rate (default 1 Gbit/s); the
   coordinator, router and proxies on the host, reached over uncapped
   management links. Systems: vLLM's pull with NIXL's progress thread off,
   vLLM's push with and without it, pushkv ordering after prefill done
   (whole-request), and pushkv with armed orders and progressive push. The
   same link, UCX settings, step budget and workload for all; ratios at the
   highest rate all sustained (of the push variants, one), else the lowest;
   against vLLM push, the faster variant there.

Every engine gets the same step budget (`--step-tokens`, default 512 here), so
that long prompts are prefilled in chunks and pushkv pushes each chunk's blocks
as it completes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Final

from pushkv.bench.output import say
from pushkv.bench.serving.config import LABELS, BenchConfig
from pushkv.bench.serving.critpath import LEFT_STAGE, POST_STAGE
from pushkv.bench.serving.deployment import Place, Placement
from pushkv.bench.serving.measure import run_system
from pushkv.bench.serving.report import report
from pushkv.bench.serving.results import SystemRun
from pushkv.harness.netlink import TwoNodeLink, check_available, format_rate

LOOP_SYSTEMS: Final = ("pushkv", "single")
LINK_SYSTEMS: Final = ("pull-noprog", "vllm-push", "vllm-push-noprog", "pushkv-whole", "pushkv")
# vLLM push is run as vLLM ships it (NIXL's progress thread on: it spins a core)
# and with that thread off, as an operator of a 2-core box would; the ratio is
# taken against the faster of the two (lower TTFT p50 at the comparison rate).
PUSH_VARIANTS: Final = ("vllm-push", "vllm-push-noprog")
# The comparison rate: the highest that these all sustained, and one push variant.
MUST_SUSTAIN: Final = ("pull-noprog", "pushkv-whole", "pushkv")
LINK_STEP_TOKENS: Final = 512
SCENARIO: Final = "nocache"


def link_placement(link: TwoNodeLink) -> Placement:
    """The prefill engine in namespace A, the decode engine in B, UCX on the KV link."""

    def place(name: str) -> Place:
        s = link.side(name)
        # VLLM_HOST_IP: the namespaces have no default route, where vLLM looks
        # for its own address; its processes talk among themselves on loopback.
        env = {**link.ucx_env(name), "VLLM_HOST_IP": "127.0.0.1"}
        return Place(netns=s.netns, host=s.mgmt_addr, kv_addr=s.kv_addr, env=env)

    return Placement(
        place("a"),
        place("b"),
        link.coordinator_host,
        name=f"emulated link ({format_rate(link.rate_bit)}, UCX over TCP)",
    )


@dataclasses.dataclass
class LinkedResult:
    loop: dict[str, SystemRun]
    link: dict[str, SystemRun]
    low_rate: float
    link_rate: float | None  # where the link ratios are taken
    link_rate_sustained: bool = False  # by all (else: the lowest rate)
    push_baseline: str = ""  # the vLLM push variant the ratio is taken against
    post_p50_ms: float = math.nan
    decode_step_ms: float = math.nan
    copy_left_ms: float = math.nan
    ratios: dict[str, float] = dataclasses.field(default_factory=dict)


def phase_configs(cfg: BenchConfig) -> tuple[BenchConfig, BenchConfig]:
    """The loopback phase's settings and the link phase's (systems and rates)."""
    loop = dataclasses.replace(cfg, systems=LOOP_SYSTEMS, rates=(cfg.low_rate,))
    link = dataclasses.replace(cfg, systems=LINK_SYSTEMS)
    return loop, link


def run_linked(cfg: BenchConfig) -> LinkedResult:
    """Both phases; the link is set up here and torn down on the way out."""
    assert cfg.link_rate_bit is not None
    check_available()  # before a first engine starts: a clear stop
    loop_cfg, link_cfg = phase_configs(cfg)
    say(f"phase 1: loopback, {cfg.low_rate:g} req/s, systems {loop_cfg.systems}")
    loop = {s: run_system(loop_cfg, s, SCENARIO) for s in loop_cfg.systems}
    say(
        f"phase 2: emulated link at {format_rate(cfg.link_rate_bit)}, rates {link_cfg.rates}, "
        f"systems {link_cfg.systems}"
    )
    with TwoNodeLink(cfg.link_rate_bit) as link:
        placement = link_placement(link)
        say(
            f"link: prefill in {placement.prefill.netns} ({placement.prefill.kv_addr}), decode "
            f"in {placement.decode.netns} ({placement.decode.kv_addr}), coordinator at "
            f"{placement.coordinator_host}; tbf burst {link.burst_b} B, latency "
            f"{link.latency_ms:g} ms"
        )
        runs = {s: run_system(link_cfg, s, SCENARIO, placement) for s in link_cfg.systems}
        end = link.qdisc_stats("a")
        say(f"link A->B tbf counters at the end: {end}")
    return summarize(cfg, loop, runs)


def _p50(run: SystemRun | None, rate: float | None, key: str) -> float:
    if run is None or run.error or rate is None:
        return math.nan
    r = run.at(rate)
    return math.nan if r is None else float(getattr(r, key)["p50"])


def _ratio(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) or b == 0 else a / b


def _sustains(run: SystemRun | None, rate: float) -> bool:
    r = None if run is None or run.error else run.at(rate)
    return r is not None and r.sustained


def _comparison_rate(link: dict[str, SystemRun], rates: Sequence[float]) -> float | None:
    """The highest rate that every system of MUST_SUSTAIN and one vLLM push
    variant sustained; None if none was."""
    best = None
    for rate in rates:
        if all(_sustains(link.get(s), rate) for s in MUST_SUSTAIN) and any(
            _sustains(link.get(s), rate) for s in PUSH_VARIANTS
        ):
            best = rate
    return best


def _push_baseline(link: dict[str, SystemRun], rate: float | None) -> str:
    """The faster vLLM push variant at `rate` among those that sustained it (any
    that ran, if none did); "" if neither ran."""
    if rate is None:
        return ""
    ran = [s for s in PUSH_VARIANTS if not math.isnan(_p50(link.get(s), rate, "ttft_ms"))]
    pool = [s for s in ran if _sustains(link.get(s), rate)] or ran
    return min(pool, key=lambda s: _p50(link.get(s), rate, "ttft_ms"), default="")


def summarize(
    cfg: BenchConfig, loop: dict[str, SystemRun], link: dict[str, SystemRun]
) -> LinkedResult:
    """The goals' figures from both phases' runs (pure)."""
    low = cfg.low_rate
    link_rate = _comparison_rate(link, cfg.rates)
    out = LinkedResult(loop, link, low, link_rate, link_rate is not None)
    if link_rate is None and cfg.rates:
        out.link_rate = link_rate = cfg.rates[0]
    out.push_baseline = _push_baseline(link, link_rate)
    pk = loop.get("pushkv")
    r = None if pk is None or pk.error else pk.at(low)
    if r is not None:
        post = r.critpath_ms.get(POST_STAGE)
        left = r.critpath_ms.get(LEFT_STAGE)
        out.post_p50_ms = post["p50"] if post else math.nan
        # The decode engine's own time for a loaded request: scheduled to its
        # first token, one forward (vLLM's request_prefill_time histogram).
        out.decode_step_ms = r.engine_ms.get("decode", {}).get("prefill", math.nan)
        out.copy_left_ms = max(0.0, left["p50"]) if left else 0.0
    limit = out.decode_step_ms + out.copy_left_ms
    pk_link = _p50(link.get("pushkv"), link_rate, "ttft_ms")
    out.ratios = {
        "post_prefill_p50_ratio_vs_limit": _ratio(out.post_p50_ms, limit),
        "ttft_p50_ratio_vs_single": _ratio(
            _p50(pk, low, "ttft_ms"), _p50(loop.get("single"), low, "ttft_ms")
        ),
        "link_ttft_p50_ratio_vs_pull": _ratio(
            pk_link, _p50(link.get("pull-noprog"), link_rate, "ttft_ms")
        ),
        "link_ttft_p50_ratio_vs_vllm_push": _ratio(
            pk_link, _p50(link.get(out.push_baseline), link_rate, "ttft_ms")
        ),
        "link_ttft_p50_ratio_vs_whole_request": _ratio(
            pk_link, _p50(link.get("pushkv-whole"), link_rate, "ttft_ms")
        ),
    }
    return out


def linked_report(cfg: BenchConfig, res: LinkedResult) -> list[str]:
    loop_cfg, link_cfg = phase_configs(cfg)
    lines = ["", "# phase 1: loopback, low load"]
    lines += report(loop_cfg, {SCENARIO: res.loop}, ("pushkv",))
    lines += ["", f"# phase 2: the emulated link ({format_rate(cfg.link_rate_bit or 0)})"]
    lines += report(link_cfg, {SCENARIO: res.link}, MUST_SUSTAIN)
    lines += [
        "",
        "# issue 19's goals",
        f"post-prefill path (loopback, {res.low_rate:g} req/s, pushkv): prefill finished -> "
        f"decode's first bytes p50 {res.post_p50_ms:.1f} ms; limit = decode step "
        f"{res.decode_step_ms:.1f} ms (the decode engine's mean time from scheduling a "
        f"loaded request to its first token) + copy left at prefill end "
        f"{res.copy_left_ms:.1f} ms (p50 of prefill finished -> last DONE heard, at least 0)",
        "link ratios at "
        + (f"{res.link_rate:g} req/s" if res.link_rate is not None else "no rate")
        + ": "
        + (
            "the highest rate that all of " + ", ".join(MUST_SUSTAIN) + " and a vLLM push "
            "variant sustained"
            if res.link_rate_sustained
            else "no rate was sustained by all: the lowest"
        )
        + f"; vLLM push baseline: {res.push_baseline or 'none'} (the faster of "
        + " and ".join(PUSH_VARIANTS)
        + ")",
        *(f"  {k} = {_fmt(v)}  (goal: {GOALS[k]})" for k, v in res.ratios.items()),
        "systems: " + "; ".join(f"{s}: {LABELS[s]}" for s in LINK_SYSTEMS),
    ]
    return lines


GOALS: Final = {
    "post_prefill_p50_ratio_vs_limit": "at most 1.3",
    "ttft_p50_ratio_vs_single": "at most 1.15",
    "link_ttft_p50_ratio_vs_pull": "at most 0.5",
    "link_ttft_p50_ratio_vs_vllm_push": "at most 0.8",
    "link_ttft_p50_ratio_vs_whole_request": "a reduction, reported",
}


def _fmt(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.3f}"


def final_line(res: LinkedResult) -> str:
    """Exactly the five ratios, in issue 19's order."""
    return " ".join(f"{k}={_fmt(v)}" for k, v in res.ratios.items())


def check_args(systems: Sequence[str] | None, **others: object) -> str | None:
    """Why `--link` cannot run with these other flags (None: it can)."""
    if systems:
        return "--link runs a fixed set of systems; drop --systems"
    for flag, value in others.items():
        if value:
            return f"--link does not take --{flag.replace('_', '-')}"
    return None
