"""The serving benchmark's report: per-scenario tables, pushkv's ratios against
each baseline, each system's critical path to the first token, where pushkv's
TTFT goes, the rate the ratios are taken at, the final line, and the TTFT plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from pushkv.bench.output import table_head, table_row
from pushkv.bench.serving.config import COMPARED, CONTROLS, SCENARIO_LABELS, BenchConfig, topology
from pushkv.bench.serving.critpath import PATH_VLLM, Quantiles, paths_of, stages_of
from pushkv.bench.serving.results import STAGES, SystemRun


def _fmt(x: float, digits: int = 0) -> str:
    return "nan" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def _ratio(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


# A TPOT p50 under this means the responses came in one chunk: a starved API
# server sent every token at once, so the client saw no time between tokens
# (a decode step here takes ~4 ms). A ratio against it would mean nothing.
TPOT_UNSEEN_MS = 0.05


def _tpot_ratio(a: float, b: float) -> float:
    return math.nan if b < TPOT_UNSEEN_MS else _ratio(a, b)


def highest_common_rate(
    runs: dict[str, SystemRun], rates: Sequence[float], compared: Sequence[str] = COMPARED
) -> float | None:
    """Highest rate sustained by every compared system that ran (failed systems excluded)."""
    alive = [runs[s] for s in compared if s in runs and not runs[s].error and runs[s].rates]
    if not alive:
        return None
    best = None
    for rate in rates:
        if all((r := run.at(rate)) is not None and r.sustained for run in alive):
            best = rate
    return best


def _metric(run: SystemRun | None, rate: float, key: str, q: str) -> float:
    if run is None or run.error:
        return math.nan
    r = run.at(rate)
    if r is None:
        return math.nan
    return float(getattr(r, key)[q])


def report(
    cfg: BenchConfig,
    all_runs: dict[str, dict[str, SystemRun]],
    compared: Sequence[str] = COMPARED,
) -> list[str]:
    lines: list[str] = []
    for scenario, runs in all_runs.items():
        lines.append("")
        lines.append(f"## scenario {scenario}: {SCENARIO_LABELS[scenario]}")
        lines.append(f"topology: {topology(cfg.prefill_tp)}")
        lines += _systems_table(cfg, runs)
        lines.append("")
        lines.append(f"ratios pushkv / baseline ({scenario}; below 1: pushkv better)")
        lines += _ratios_table(cfg, runs)
        lines += _critpath_tables(scenario, runs)
        lines += _stages_table(scenario, runs.get("pushkv"))
        best = highest_common_rate(runs, cfg.rates, compared)
        lines.append(
            f"highest rate sustained by all of {', '.join(s for s in compared if s in runs)}: "
            + (f"{best:g} req/s" if best is not None else "none")
        )
        ref = single_floor(cfg, runs)
        if ref is not None:
            lines.append(ref)
    return lines


def _systems_table(cfg: BenchConfig, runs: dict[str, SystemRun]) -> list[str]:
    lines = table_head(
        "rate (req/s)",
        "system",
        "ok/n",
        "failed",
        "timed out",
        "offered / achieved (req/s)",
        "TTFT p50 / p90 / p99 (ms)",
        "TTST p50 (ms)",
        "TPOT p50 / p90 / p99 (ms)",
        "sustained",
    )
    for rate in cfg.rates:
        for system in cfg.systems:
            run = runs.get(system)
            if run is None:
                continue
            if run.error:
                lines.append(f"| {rate:g} | {system} | FAILED: {run.error} ||||||||")
                continue
            r = run.at(rate)
            if r is None:
                continue
            t, p = r.ttft_ms, r.tpot_ms
            lines.append(
                table_row(
                    f"{rate:g}",
                    system,
                    f"{r.ok}/{r.n}",
                    r.failed,
                    r.timed_out,
                    f"{r.offered_rps:.2f} / {r.throughput_rps:.2f}",
                    f"{_fmt(t['p50'])} / {_fmt(t['p90'])} / {_fmt(t['p99'])}",
                    _fmt(r.ttst_ms.get("p50", math.nan)),
                    f"{_fmt(p['p50'], 1)} / {_fmt(p['p90'], 1)} / {_fmt(p['p99'], 1)}",
                    "yes" if r.sustained else "no",
                )
            )
    return lines


def _ratios_table(cfg: BenchConfig, runs: dict[str, SystemRun]) -> list[str]:
    quantiles = ("p50", "p90", "p99")
    lines = table_head(
        "rate", "pushkv vs", *(f"{m} {q}" for m in ("TTFT", "TPOT") for q in quantiles)
    )
    pk = runs.get("pushkv")
    unseen = False
    for rate in cfg.rates:
        for base in ("pull", "vllm-push", *CONTROLS):
            other = runs.get(base)
            if other is None:
                continue
            cells = [
                _fmt(_ratio(_metric(pk, rate, "ttft_ms", q), _metric(other, rate, "ttft_ms", q)), 2)
                for q in quantiles
            ]
            for q in quantiles:
                b = _metric(other, rate, "tpot_ms", q)
                seen = not b < TPOT_UNSEEN_MS
                unseen = unseen or not seen
                a = _metric(pk, rate, "tpot_ms", q)
                cells.append(_fmt(_tpot_ratio(a, b), 2) if seen else "n/a")
            lines.append(table_row(f"{rate:g}", base, *cells))
    if unseen:
        lines.append(
            "n/a: the baseline's TPOT rounds to 0.0 ms: its API server sent most "
            "responses in one chunk, so the client saw no time between tokens"
        )
    return lines


def _cell(q: Quantiles | None, digits: int = 0) -> str:
    """ "p50 / p99" of a stage, or "-" where it was not observed."""
    return "-" if q is None else f"{_fmt(q['p50'], digits)} / {_fmt(q['p99'], digits)}"


def _critpath_tables(scenario: str, runs: dict[str, SystemRun]) -> list[str]:
    lines: list[str] = []
    for system, run in runs.items():
        if run.error or not any(r.critpath_ms for r in run.rates):
            continue
        for path in paths_of(system):
            stages = stages_of(path)
            what = (
                "the stages the front sees (as for vLLM's connectors)"
                if path == PATH_VLLM and system.startswith("pushkv")
                else "critical path to the first token"
            )
            lines += [
                "",
                f"{system}: {what} ({scenario}; p50 / p99 in ms over requests; "
                'docs/benchmarks.md, "Critical path")',
                *table_head("rate", *stages),
            ]
            for r in run.rates:
                cells = (_cell(r.critpath_ms.get(s), 1) for s in stages)
                lines.append(table_row(f"{r.rate:g}", *cells))
    return lines


def _stages_table(scenario: str, pk_run: SystemRun | None) -> list[str]:
    if pk_run is None or not any(r.stages_ms for r in pk_run.rates):
        return []
    lines = [
        "",
        f"pushkv: where TTFT goes ({scenario}; p50 / p99 in ms over requests, "
        "from the coordinator's transfer timelines)",
        *table_head("rate", *(name for name, _, _ in STAGES)),
    ]
    for r in pk_run.rates:
        cells = [_cell(r.stages_ms.get(name)) for name, _, _ in STAGES]
        lines.append(table_row(f"{r.rate:g}", *cells))
    return lines


def single_floor(cfg: BenchConfig, runs: dict[str, SystemRun]) -> str | None:
    """The single engine's TTFT p50 over pull's at the comparison rate: the ratio a
    system with no transfer and no second engine reaches on this machine, a
    reference for the TTFT goals. None unless both ran."""
    if "single" not in runs or "pull" not in runs:
        return None
    rate = comparison_rate(cfg, runs)
    if rate is None:
        return None
    x = _ratio(
        _metric(runs["single"], rate, "ttft_ms", "p50"),
        _metric(runs["pull"], rate, "ttft_ms", "p50"),
    )
    return (
        f"reference at {rate:g} req/s: single-engine TTFT p50 / pull = {_fmt(x, 2)} "
        "(no transfer, no second engine)"
    )


def comparison_rate(cfg: BenchConfig, runs: dict[str, SystemRun]) -> float | None:
    """Where the final line's ratios are taken: the highest rate all compared
    systems sustained, else the lowest rate (said in the table)."""
    best = highest_common_rate(runs, cfg.rates)
    if best is None:
        best = cfg.rates[0] if cfg.rates else None
    return best


def final_line(cfg: BenchConfig, runs: dict[str, SystemRun]) -> tuple[str, float | None]:
    best = comparison_rate(cfg, runs)
    pk, pl, vp = runs.get("pushkv"), runs.get("pull"), runs.get("vllm-push")
    if best is None:
        x = y = z = math.nan
    else:
        x = _ratio(_metric(pk, best, "ttft_ms", "p50"), _metric(pl, best, "ttft_ms", "p50"))
        y = _ratio(_metric(pk, best, "ttft_ms", "p50"), _metric(vp, best, "ttft_ms", "p50"))
        z = _tpot_ratio(_metric(pk, best, "tpot_ms", "p50"), _metric(pl, best, "tpot_ms", "p50"))

    def f(v: float) -> str:
        return "nan" if math.isnan(v) else f"{v:.3f}"

    return (
        f"ttft_p50_ratio_vs_pull={f(x)} ttft_p50_ratio_vs_vllm_push={f(y)} "
        f"tpot_p50_ratio_vs_pull={f(z)}",
        best,
    )


def plot(cfg: BenchConfig, all_runs: dict[str, dict[str, SystemRun]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(all_runs)
    fig, axes = plt.subplots(1, len(scenarios), figsize=(6.4 * len(scenarios), 4.6), squeeze=False)
    styles = {
        "pull": "o-",
        "vllm-push": "s-",
        "pushkv": "D-",
        "single": "x--",
        "pull-noprog": "o:",
        "vllm-push-noprog": "s:",
    }
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        for system, run in all_runs[scenario].items():
            if run.error or not run.rates:
                continue
            xs = [r.rate for r in run.rates]
            ys = [r.ttft_ms["p50"] for r in run.rates]
            style = styles.get(system, "o-")
            if system == "single":
                ax.plot(xs, ys, style, color="black", label=system)
            else:
                ax.plot(xs, ys, style, label=system)
            bad = [r for r in run.rates if not r.sustained and not math.isnan(r.ttft_ms["p50"])]
            ax.scatter(
                [r.rate for r in bad],
                [r.ttft_ms["p50"] for r in bad],
                s=170,
                facecolors="none",
                edgecolors="red",
                linewidths=1.2,
            )
        ax.set_title(f"{scenario}: {SCENARIO_LABELS[scenario]}", fontsize=9)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"TTFT p50 vs rate; Llama {cfg.layers}L h{cfg.hidden} fp32, prompts "
        f"{cfg.min_prompt}-{cfg.max_prompt} tok, {cfg.output_len} out\n"
        + (
            "P core 0, D core 1 (single: core 0)"
            if cfg.prefill_tp == 1
            else f"P TP{cfg.prefill_tp} cores 0|1, D TP1 core 1 (single: TP1 core 0)"
        )
        + "; red ring: rate not sustained",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
