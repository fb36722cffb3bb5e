"""The serving benchmark's report (scripts/bench_serving.py): latency percentiles of a run's finished requests, the
markdown table of a sweep, and its plot."""
from __future__ import annotations

import math
from typing import Any, Dict, List


def pct(xs: List[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats(xs: List[float]) -> Dict[str, float]:
    ms = [x * 1000 for x in xs]
    return {"mean": sum(ms) / len(ms) if ms else float("nan"), "p50": pct(ms, 50), "p90": pct(ms, 90),
            "p99": pct(ms, 99)}


def latencies(results: List[Any]) -> Dict[str, Any]:
    """TTFT, ITL (every gap between two chunks of a request), TPOT and E2E of a set of finished requests
    (bench_serving.Result)."""
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    return {"completed": len(results), "output_tokens": sum(r.output_tokens for r in results),
            "mean_output_tokens": sum(r.output_tokens for r in results) / len(results) if results else float("nan"),
            "ttft_ms": stats([r.ttft for r in results]), "itl_ms": stats([x for r in results for x in r.itl]),
            "tpot_ms": stats(tpot), "e2e_ms": stats([r.e2e for r in results])}


def table(rows: List[Dict[str, Any]]) -> str:
    head = ("| rate (req/s) | done | req/s | out tok/s | TTFT mean / p50 / p90 / p99 (ms) | "
            "ITL mean / p50 / p90 / p99 (ms) | E2E mean / p50 / p90 / p99 (ms) |")
    lines = [head, "|" + "---|" * 7]

    def four(d: Dict[str, float]) -> str:
        return " / ".join(f"{d[k]:.0f}" for k in ("mean", "p50", "p90", "p99"))

    for r in rows:
        lines.append(f"| {r['request_rate']} | {r['completed']}/{r['num_prompts']} | {r['request_throughput']:.2f} "
                     f"| {r['output_throughput']:.1f} | {four(r['ttft_ms'])} | {four(r['itl_ms'])} "
                     f"| {four(r['e2e_ms'])} |")
    if any("constrained" in r for r in rows):
        lines += ["", "| rate (req/s) | requests | done | mean out tokens | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
                      "E2E p50 / p99 (ms) |", "|" + "---|" * 7]
        for r in rows:
            for kind in ("constrained", "unconstrained", None):
                part = r[kind] if kind else r
                n = part["num_prompts"]
                lines.append(f"| {r['request_rate']} | {kind or 'all'} | {part['completed']}/{n} "
                             f"| {part['mean_output_tokens']:.1f} | "
                             + " | ".join(f"{part[k]['p50']:.1f} / {part[k]['p99']:.1f}"
                                          for k in ("ttft_ms", "itl_ms", "e2e_ms")) + " |")
    return "\n".join(lines)


def plot(rows: List[Dict[str, Any]], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [float(r["request_rate"]) for r in rows if r["request_rate"] != "inf"]
    inf_x = (max(finite) * 2 if finite else 1.0)
    xs = [inf_x if r["request_rate"] == "inf" else float(r["request_rate"]) for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, key, name in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms"), ("TTFT", "ITL", "E2E latency")):
        for q, style in (("mean", "o-"), ("p50", "s--"), ("p99", "^:")):
            ax.plot(xs, [r[key][q] for r in rows], style, label=q)
        ax.set_title(f"{name} (ms)")
        ax.legend()
    axes[3].plot(xs, [r["output_throughput"] for r in rows], "o-")
    axes[3].set_title("output throughput (tok/s)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(r["request_rate"]) for r in rows])
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
