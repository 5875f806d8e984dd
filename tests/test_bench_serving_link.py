"""`pushkv bench serving --link`: its settings and refusals, the goals' figures
and final line from both phases' runs, and, with real vLLM engines, that the
benchmark's pushkv deployment between the two namespaces serves through the
capped link: the KV crosses namespace A's token bucket and the decode engine
loads it, with the outputs of an independent engine that has no connector."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pushkv.bench.serving import deployment
from pushkv.bench.serving.config import BenchConfig
from pushkv.bench.serving.critpath import LEFT_STAGE, POST_STAGE
from pushkv.bench.serving.linked import (
    LINK_STEP_TOKENS,
    LINK_SYSTEMS,
    LOOP_SYSTEMS,
    final_line,
    link_placement,
    phase_configs,
    summarize,
)
from pushkv.bench.serving.main import _parse
from pushkv.bench.serving.results import RateResult, SystemRun
from pushkv.harness.netlink import TwoNodeLink, parse_rate
from pushkv.harness.tiny_model import model_params
from pushkv.harness.vllm_server import VllmServer
from pushkv.v1 import pushkv_pb2 as pb
from tests.support.serving import completion, external_tokens, one_by_one, settled, varied_prompts

# ------------------------------------------------------------------ settings


def test_link_quick_sets_the_phases_and_a_step_budget() -> None:
    cfg, _ = _parse(["--quick", "--link"])
    assert cfg.link_rate_bit == 10**9
    assert cfg.step_tokens == LINK_STEP_TOKENS  # chunked prefill: progressive push
    assert cfg.rates == (0.5, 1.0) and cfg.low_rate == 0.5
    loop, link = phase_configs(cfg)
    assert (loop.systems, loop.rates) == (LOOP_SYSTEMS, (0.5,))
    assert (link.systems, link.rates) == (LINK_SYSTEMS, (0.5, 1.0))
    assert LINK_SYSTEMS == (
        "pull-noprog",
        "vllm-push",
        "vllm-push-noprog",
        "pushkv-whole",
        "pushkv",
    )
    cfg, _ = _parse(["--link", "500mbit", "--step-tokens", "256", "--low-rate", "0.25"])
    assert (cfg.link_rate_bit, cfg.step_tokens, cfg.low_rate) == (5 * 10**8, 256, 0.25)
    assert _parse(["--quick"])[0].link_rate_bit is None  # no --link: the usual run


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--systems", "pushkv"], "fixed set of systems"),
        (["--scenarios", "prefixhit"], "--link does not take --scenarios"),
        (["--prefill-tp", "2"], "--link does not take --prefill-tp"),
        (["--link", "fast"], "not a rate"),
        (["--low-rate", "0"], "--low-rate must be positive"),
    ],
)
def test_link_refuses(args: list[str], why: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = args if "--link" in args else ["--link", *args]
    with pytest.raises(SystemExit):
        _parse(["--quick", *argv])
    assert why in capsys.readouterr().err


# ------------------------------------------------------------------ the goals' figures


def _rate(rate: float, ttft: float, sustained: bool = True, **extra: object) -> RateResult:
    q = {"p50": ttft, "p90": ttft, "p99": ttft}
    r = RateResult(rate, 10, 10, 0, 0, rate, rate, rate, q, q, ttft + 100, sustained)
    for k, v in extra.items():
        setattr(r, k, v)
    return r


def _run(system: str, *rates: RateResult) -> SystemRun:
    run = SystemRun(system, "nocache")
    run.rates = list(rates)
    return run


def _cfg() -> BenchConfig:
    return BenchConfig(model_dir=Path("/x"), rates=(0.5, 1.0), link_rate_bit=10**9, low_rate=0.5)


def test_summarize_takes_each_goal_from_its_phase_and_rate() -> None:
    crit = {
        POST_STAGE: {"p50": 30.0, "p99": 60.0, "n": 10.0},
        LEFT_STAGE: {"p50": 5.0, "p99": 9.0, "n": 10.0},
    }
    loop = {
        "pushkv": _run(
            "pushkv",
            _rate(0.5, 330.0, critpath_ms=crit, engine_ms={"decode": {"prefill": 15.0}}),
        ),
        "single": _run("single", _rate(0.5, 300.0)),
    }
    link = {
        "pull-noprog": _run("pull-noprog", _rate(0.5, 1000.0), _rate(1.0, 2000.0)),
        # vLLM push as shipped is faster at 0.5 req/s, but only its control
        # sustains 1 req/s
        "vllm-push": _run("vllm-push", _rate(0.5, 800.0), _rate(1.0, 900.0, sustained=False)),
        "vllm-push-noprog": _run("vllm-push-noprog", _rate(0.5, 900.0), _rate(1.0, 1600.0)),
        "pushkv-whole": _run("pushkv-whole", _rate(0.5, 600.0), _rate(1.0, 500.0)),
        # 1 req/s is not sustained by pushkv: the ratios are taken at 0.5
        "pushkv": _run("pushkv", _rate(0.5, 400.0), _rate(1.0, 100.0, sustained=False)),
    }
    res = summarize(_cfg(), loop, link)
    assert (res.link_rate, res.link_rate_sustained, res.push_baseline) == (0.5, True, "vllm-push")
    assert (res.post_p50_ms, res.decode_step_ms, res.copy_left_ms) == (30.0, 15.0, 5.0)
    assert final_line(res) == (
        "post_prefill_p50_ratio_vs_limit=1.500 ttft_p50_ratio_vs_single=1.100 "
        "link_ttft_p50_ratio_vs_pull=0.400 link_ttft_p50_ratio_vs_vllm_push=0.500 "
        "link_ttft_p50_ratio_vs_whole_request=0.667"
    )
    # pushkv sustains 1 req/s too: the ratios move there, against the push
    # variant that sustained it.
    link["pushkv"].rates[1] = _rate(1.0, 100.0)
    res = summarize(_cfg(), loop, link)
    assert (res.link_rate, res.push_baseline) == (1.0, "vllm-push-noprog")
    assert res.ratios["link_ttft_p50_ratio_vs_pull"] == 0.05
    assert res.ratios["link_ttft_p50_ratio_vs_vllm_push"] == 100.0 / 1600.0
    # Nobody sustains anything: the lowest rate, said so.
    for run in link.values():
        for r in run.rates:
            r.sustained = False
    res = summarize(_cfg(), loop, link)
    assert (res.link_rate, res.link_rate_sustained, res.push_baseline) == (0.5, False, "vllm-push")


def test_a_write_done_before_the_prefill_finished_leaves_no_copy() -> None:
    crit = {
        POST_STAGE: {"p50": 26.0, "p99": 60.0, "n": 10.0},
        LEFT_STAGE: {"p50": -3.0, "p99": 1.0, "n": 10.0},  # armed: DONE before the stamp
    }
    loop = {"pushkv": _run("pushkv", _rate(0.5, 1.0, critpath_ms=crit, engine_ms={}))}
    res = summarize(_cfg(), loop, {})
    assert res.copy_left_ms == 0.0
    # No decode engine figure, no single, no link runs: nan, never a made-up number.
    assert all(math.isnan(v) for v in res.ratios.values())
    assert final_line(res).split() == [
        "post_prefill_p50_ratio_vs_limit=nan",
        "ttft_p50_ratio_vs_single=nan",
        "link_ttft_p50_ratio_vs_pull=nan",
        "link_ttft_p50_ratio_vs_vllm_push=nan",
        "link_ttft_p50_ratio_vs_whole_request=nan",
    ]


# ------------------------------------------------------------------ real engines on the link


@pytest.mark.e2e
def test_pushkv_serves_through_the_emulated_link(tiny_model_dir: Path) -> None:
    """The benchmark's own pushkv deployment, prefill engine in namespace A and
    decode engine in B: each prompt's KV crosses A's capped egress and the
    decode engine loads it; the outputs equal an independent engine's."""
    model = tiny_model_dir
    cfg = BenchConfig(
        model_dir=model,
        block_size=32,
        max_prompt=600,
        output_len=8,
        max_num_seqs=16,
        kvcache_gib=1,
        step_tokens=128,  # prompts over 128 tokens: chunked, pushed chunk by chunk
        startup_timeout_s=240.0,
    )
    prompts = varied_prompts(11, (40, 129, 300, 450, 600))
    ref = VllmServer(model, "reference", block_size=32, max_model_len=cfg.max_model_len)
    try:
        ref.start().wait_ready(240)
        expected = one_by_one(ref.url, prompts, 8)
    finally:
        ref.stop()
    with TwoNodeLink(parse_rate("1gbit")) as link:
        placement = link_placement(link)
        dep = deployment.deploy(cfg, "pushkv", "nocache", placement)
        try:
            decode = dep.servers[1]
            assert decode.url.startswith(f"http://{placement.decode.host}:")
            before = link.qdisc_stats("a")
            loaded0 = external_tokens(decode.metrics())
            got = [completion(dep.front_url, p, 8) for p in prompts]
            done = settled(dep.coordinator, len(prompts), set(), timeout=120)
            after = link.qdisc_stats("a")
            loaded = external_tokens(decode.metrics()) - loaded0
        finally:
            dep.stop()
    assert got == expected
    assert {t.state for t in done} == {pb.TRANSFER_STATE_COMPLETE}, done
    assert loaded == sum(len(p) for p in prompts), "decode recomputed instead of loading"
    # KV per token: layers x (K, V) x KV heads x head size x fp32. At least the
    # loaded tokens' KV went through A's token bucket (TCP/IP headers on top).
    m = model_params()
    per_token = int(m["layers"]) * 2 * int(m["num_key_value_heads"]) * int(m["head_dim"]) * 4
    assert after.bytes - before.bytes >= loaded * per_token
