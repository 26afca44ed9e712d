"""bench/serve.py's figures: a load level's summary of its requests, the table, the ratios to
the peers, the CPU per output token, and the plots."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import percentile_ms

if TYPE_CHECKING:
    from bench.serve import Record

INSTALL_HINT = "pip install -e '.[bench]'"


def summarize(records: list[Record], wall_s: float, level: float) -> dict:
    """The level's figures; latencies in ms over successful requests, ITL pooled over them."""
    ok = [r for r in records if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [g for r in ok for g in r.itls]
    e2es = [r.end - r.start for r in ok]
    tokens = sum(r.tokens for r in ok)
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    errors = [r for r in records if r.error is not None]
    return {
        "level": level,
        "requests": len(records),
        "completed": len(ok),
        "errors": len(errors),
        "timeouts": sum(r.timed_out for r in errors),
        "error_samples": sorted({r.error for r in errors})[:3],
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "mean_output_tokens": tokens / len(ok) if ok else None,
        "mean_prompt_tokens": sum(prompt) / len(prompt) if prompt else None,
        "usage_reported": sum(r.output_tokens is not None for r in ok),
        **{f"ttft_p{q}_ms": percentile_ms(ttfts, q / 100) for q in (50, 90, 99)},
        **{f"itl_p{q}_ms": percentile_ms(itls, q / 100) for q in (50, 90, 99)},
        **{f"e2e_p{q}_ms": percentile_ms(e2es, q / 100) for q in (50, 99)},
    }


COLUMNS = [  # (figure key, header, width, format)
    ("requests", "reqs", 5, "d"),
    ("errors", "err", 4, "d"),
    ("output_tokens_per_s", "out tok/s", 10, ".1f"),
    ("requests_per_s", "req/s", 7, ".2f"),
    ("ttft_p50_ms", "TTFT p50", 9, ".1f"),
    ("ttft_p90_ms", "p90", 8, ".1f"),
    ("ttft_p99_ms", "p99", 8, ".1f"),
    ("itl_p50_ms", "ITL p50", 8, ".1f"),
    ("itl_p90_ms", "p90", 8, ".1f"),
    ("itl_p99_ms", "p99", 8, ".1f"),
    ("e2e_p50_ms", "e2e p50", 9, ".0f"),
    ("e2e_p99_ms", "p99", 8, ".0f"),
    ("mean_output_tokens", "mean out", 9, ".1f"),
]


def print_table(results: dict, args) -> None:
    what = "rate/s" if args.rate else "conc"
    head = f"{'target':<12} {what:>6}" + "".join(f" {h:>{w}}" for _, h, w, _ in COLUMNS)
    print(f"\n{head}\n{'-' * len(head)}")
    for name, res in results.items():
        for fig in res["levels"]:
            cells = []
            for key, _, width, fmt in COLUMNS:
                value = fig.get(key)
                cells.append(f" {'-' if value is None else format(value, fmt):>{width}}")
            print(f"{name:<12} {fig['level']:>6g}" + "".join(cells))
    print("latencies in ms; ITL = gaps between chunks with text (a multi-token chunk is one gap)")
    for line in ratio_lines(results, args) + cpu_lines(results):
        print(line)


def cpu_lines(results: dict, top: int = 4) -> list[str]:
    """CPU per output token, level by level: the load generator's, and the server's with its
    busiest processes where it was measured (--server-pid, and the peers this bench starts)."""
    lines = []
    for name, res in results.items():
        for fig in res["levels"]:
            client = fig.get("client_cpu_us_per_token")
            if client is None:
                continue
            line = f"CPU per output token, {name} at {fig['level']:g}: client {client:.0f} us"
            server = fig.get("server_cpu_us_per_token")
            if server is not None:
                tokens = fig["output_tokens"]
                parts = [f"{1e6 * s / tokens:.0f} {label}" for label, s in
                         list(fig["server_cpu_by_process_s"].items())[:top]]  # fmt: skip
                line += f"; server {server:.0f} us ({'; '.join(parts)})"
            lines.append(line)
    return lines


def ratio_lines(results: dict, args) -> list[str]:
    """Each target's output tokens/s over each peer's, level by level (peers: --peers)."""
    peers = [name for name in args.peers if results.get(name, {}).get("levels")]
    lines = []
    for name in (t.name for t in args.targets):
        mine = {f["level"]: f["output_tokens_per_s"] for f in results[name]["levels"]}
        for peer in peers:
            theirs = {f["level"]: f["output_tokens_per_s"] for f in results[peer]["levels"]}
            cells = [
                f"{level:g}: {mine[level] / theirs[level]:.2f}x"
                for level in args.levels
                if mine.get(level) and theirs.get(level)
            ]
            if cells:
                lines.append(f"{name} / {peer} output tok/s  " + "  ".join(cells))
    return lines


def _series(res: dict, key: str) -> tuple[list[float], list[float]]:
    """(levels, figures) of one target; a figure a level lacks (all failed) is a gap."""
    xs = [f["level"] for f in res["levels"]]
    return xs, [math.nan if f[key] is None else f[key] for f in res["levels"]]


def _finish(ax, levels: list, xlabel: str, ylabel: str, title: str) -> None:
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, xscale="log")
    ax.set_xticks(levels, [f"{x:g}" for x in levels])  # the levels themselves, not 10^k
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")


def plot(results: dict, prefix: Path, args) -> list[Path]:
    """PREFIX-throughput.png and PREFIX-latency.png, one line per target; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed, so no plots; to get them: {INSTALL_HINT}")
        return []
    xlabel = "request rate (req/s)" if args.rate else "concurrency"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = [Path(f"{prefix}-throughput.png"), Path(f"{prefix}-latency.png")]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, res in results.items():
        ax.plot(*_series(res, "output_tokens_per_s"), marker="o", label=name)
    _finish(ax, args.levels, xlabel, "output tokens/s", "throughput")
    fig.savefig(paths[0], dpi=100, bbox_inches="tight")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in zip(axes, ("ttft", "itl"), ("TTFT", "inter-token latency"), strict=True):
        for i, (name, res) in enumerate(results.items()):
            for q, style in ((50, "-"), (90, "--"), (99, ":")):
                xs, ys = _series(res, f"{key}_p{q}_ms")
                ax.plot(xs, ys, style, color=f"C{i}", marker="o", label=f"{name} p{q}")
        _finish(ax, args.levels, xlabel, "ms", title)
    fig.savefig(paths[1], dpi=100, bbox_inches="tight")
    plt.close("all")
    return paths
