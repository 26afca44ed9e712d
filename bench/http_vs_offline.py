"""How much of the offline engine's throughput the server keeps over HTTP, measured in pairs.

    .venv/bin/python -m bench.http_vs_offline                  # bench/demo.yaml, 3 pairs
    .venv/bin/python -m bench.http_vs_offline --dtype float32 --pairs 5
    .venv/bin/python -m bench.http_vs_offline --config my-deployments.yaml --concurrency 64

Each pair measures the same workload twice, one after the other, with nothing else running:

* over HTTP: the server started from `--config` (`python -m serve_app`, on a free port, every
  model's dtype set to `--dtype` when given), `--concurrency` streaming `/v1/completions` of
  bench/serve.py for `--duration` seconds (random token-id prompts, EOS ignored), with the CPU of
  every process of the server's tree; then the server is stopped;
* offline: bench/engine.py, our engine alone on the same model and dtype, `--concurrency`
  requests of the same prompt and output lengths generated at once on every core (the median of
  `--repeats` runs).

The pairs alternate which comes first, and each pair's ratio compares measurements taken a
minute apart: a machine whose speed drifts (a shared or thermally limited CPU) moves both. The
result is the ratio of the means and each pair's ratio, a table and a JSON file. On a machine
where the server's processes share the engine's cores, what HTTP keeps is what the serving path
(ingress, model replica, Ray, the load generator itself) leaves of those cores: bench/serve.py's
CPU per output token, in the JSON, says where it goes. Linux (/proc) only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

from bench import common  # noqa: E402
from bench.common import Run, default_out, log, machine_info  # noqa: E402
from bench.server_process import (  # noqa: E402
    START_TIMEOUT_S,
    first_model,
    resolved_dtype,
    server_config,
    start_server,
    stop_server,
    wait_ready,
)

# -- the two measurements -----------------------------------------------------------------------


def measure_http(url: str, pid: int, model: str, vocab: int, args, out: Path) -> dict:
    """bench/serve.py at `--concurrency` streams against the server (base URL `url`, process
    `pid`): the level's figures."""
    from bench import serve as load

    argv = [f"--target=ours={url}/v1", f"--model={model}", f"--server-pid={pid}",
            "--token-ids", f"--vocab-size={vocab}", "--ignore-eos",
            f"--prompt-len={args.prompt_len}", f"--output-len={args.output_len}",
            f"--concurrency={args.concurrency}",
            f"--duration={args.duration}", "--no-plot", "--no-progress",
            f"--out={out}"]  # fmt: skip
    if args.stream_interval is not None:
        argv.append(f"--stream-interval={args.stream_interval}")
    return load.bench(load.parse_args(argv))["results"]["ours"]["levels"][0]


def offline_command(weights: str, dtype: str, args, out: Path) -> list[str]:
    return [sys.executable, "-m", "bench.engine", f"--model={weights}", f"--dtype={dtype}",
            f"--requests={args.concurrency}", f"--prompt-len={args.prompt_len}",
            f"--output-len={args.output_len}", f"--repeats={args.repeats}", "--one-at-a-time=1",
            "--hf-budget=0", f"--out={out}"]  # fmt: skip


def measure_offline(weights: str, dtype: str, args, out: Path) -> dict:
    """bench/engine.py, our engine only, in a process of its own: its figures in `dtype`."""
    done = subprocess.run(offline_command(weights, dtype, args, out), cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"bench/engine.py exited with {done.returncode}")
    return offline_figures(json.loads(out.read_text()), dtype)


def offline_figures(report: dict, dtype: str) -> dict:
    ours = report["results"][dtype]["systems"]["ours"]
    return {"output_tokens_per_s": ours["tokens_per_s"], "runs_s": ours.get("runs_s")}


# -- the pairs ----------------------------------------------------------------------------------


def order(pair: int) -> tuple[str, str]:
    """Which measurement comes first in pair `pair` (0-based): alternating, HTTP first."""
    return ("http", "offline") if pair % 2 == 0 else ("offline", "http")


def cpu_split(http: dict) -> dict | None:
    """Where an HTTP run's CPU went per output token: the server's busiest process (the engine
    process, where the engine has one), the rest of the server and the load generator, and the
    busiest's share of all three: about what HTTP keeps of the offline engine where they all
    share the engine's cores. Processes are told apart by bench/proc_cpu.py's labels (the start
    of a command line): two engine processes of one command are one "process" here. None
    without the server's CPU figures."""
    by_process, tokens = http.get("server_cpu_by_process_s"), http.get("output_tokens")
    if not by_process or not tokens:
        return None
    label, busiest = max(by_process.items(), key=lambda item: item[1])
    per_token = 1e6 / tokens
    busiest_us = busiest * per_token
    rest_us = (sum(by_process.values()) - busiest) * per_token
    client_us = http["client_cpu_s"] * per_token
    return {
        "busiest_process": label,
        "busiest_us": busiest_us,
        "rest_of_server_us": rest_us,
        "client_us": client_us,
        "busiest_share": busiest_us / (busiest_us + rest_us + client_us),
    }


def summarize(pairs: list[dict]) -> dict:
    http = [p["http_tok_s"] for p in pairs]
    offline = [p["offline_tok_s"] for p in pairs]
    ratios = [p["ratio"] for p in pairs]
    shares = [p["cpu_us_per_token"]["busiest_share"] for p in pairs if p.get("cpu_us_per_token")]
    return {
        "pairs": len(pairs),
        "http_mean_tok_s": statistics.fmean(http),
        "offline_mean_tok_s": statistics.fmean(offline),
        "ratio_of_means": statistics.fmean(http) / statistics.fmean(offline),
        "pair_ratio_min": min(ratios),
        "pair_ratio_max": max(ratios),
        "busiest_share_mean": statistics.fmean(shares) if shares else None,
    }


def prompt_vocab(weights: str) -> int:
    """The prompt ids' bound, as bench/engine.py draws them (common.prompt_vocab)."""
    from serve_app.models.loader import resolve_model_path

    return common.prompt_vocab(resolve_model_path(weights))


def run(args) -> dict:
    spec = yaml.safe_load(args.config.read_text(encoding="utf-8")) or {}
    model, weights, config_dtype = first_model(spec)
    dtype = args.dtype or resolved_dtype(config_dtype)
    vocab = prompt_vocab(weights)
    record = Run.begin(
        machine_info(("ray", "torch", "httptools", "uvloop"), client="bench/serve.py")
    )
    workload = {
        "config": str(args.config),
        "model": model,
        "dtype": dtype,
        "concurrency": args.concurrency,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "prompt_ids_below": vocab,
        "duration_s": args.duration,
        "stream_interval": args.stream_interval,
        "offline_repeats": args.repeats,
    }
    pairs: list[dict] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.pairs):
                pairs.append(run_pair(i, spec, model, weights, dtype, vocab, args, Path(tmp)))
    except BaseException:
        if pairs:  # what was measured is kept, marked as cut short
            record.write(args.out, workload=workload, pairs=pairs, summary=summarize(pairs),
                         incomplete=True)  # fmt: skip
        raise
    summary = summarize(pairs)
    print_table(pairs, summary)
    record.write(args.out, workload=workload, pairs=pairs, summary=summary)
    return {"pairs": pairs, "summary": summary}


def run_pair(i: int, spec: dict, model: str, weights: str, dtype: str, vocab: int, args,
             tmp: Path) -> dict:  # fmt: skip
    """Pair i: HTTP and offline in `order(i)`, and their ratio."""
    pair: dict = {"order": list(order(i))}
    for what in order(i):
        if what == "http":
            log(f"pair {i + 1}: starting the server ...")
            server_log = tmp / f"server-{i}.log"
            process, url = start_server(server_config(spec, args.dtype), server_log)
            try:
                wait_ready(url, args.start_timeout, process, server_log)
                http = measure_http(url, process.pid, model, vocab, args, tmp / f"http-{i}.json")
            finally:
                stop_server(process)
            if http["errors"] or not http["completed"]:
                raise RuntimeError(
                    f"pair {i + 1}: {http['errors']} of {http['requests']} requests over HTTP "
                    f"failed, e.g. {http['error_samples'][:1]}"
                )
            pair["http"] = http
            time.sleep(args.settle)  # Ray's processes gone, the cores quiet again
        else:
            log(f"pair {i + 1}: the offline engine ...")
            pair["offline"] = measure_offline(weights, dtype, args, tmp / f"offline-{i}.json")
    pair["http_tok_s"] = pair["http"]["output_tokens_per_s"]
    pair["offline_tok_s"] = pair["offline"]["output_tokens_per_s"]
    pair["ratio"] = pair["http_tok_s"] / pair["offline_tok_s"]
    pair["cpu_us_per_token"] = cpu_split(pair["http"])
    log(f"pair {i + 1}: HTTP {pair['http_tok_s']:.1f} tok/s, offline "
        f"{pair['offline_tok_s']:.1f}: {100 * pair['ratio']:.0f} %")  # fmt: skip
    return pair


def print_table(pairs: list[dict], summary: dict) -> None:
    row = "{:<5} {:<8} {:>10} {:>13} {:>12}  {:>8} {:>7} {:>7} {:>6}"
    heads = ("pair", "first", "HTTP tok/s", "offline tok/s", "HTTP/offline",
             "busiest", "rest", "client", "share")  # fmt: skip
    print("\n" + row.format(*heads))
    for i, p in enumerate(pairs, 1):
        cpu = p.get("cpu_us_per_token")
        cpus = ("-",) * 4
        if cpu:
            cpus = (f"{cpu['busiest_us']:.0f}", f"{cpu['rest_of_server_us']:.0f}",
                    f"{cpu['client_us']:.0f}", f"{100 * cpu['busiest_share']:.1f}%")  # fmt: skip
        ratio = f"{100 * p['ratio']:.1f}%"
        figures = (f"{p['http_tok_s']:.1f}", f"{p['offline_tok_s']:.1f}", ratio)
        print(row.format(i, p["order"][0], *figures, *cpus))
    s = summary
    means = (f"{s['http_mean_tok_s']:.1f}", f"{s['offline_mean_tok_s']:.1f}",
             f"{100 * s['ratio_of_means']:.1f}%")  # fmt: skip
    share = "-" if s["busiest_share_mean"] is None else f"{100 * s['busiest_share_mean']:.1f}%"
    print(row.format("mean", "", *means, "", "", "", share))
    spread = f"{100 * s['pair_ratio_min']:.0f}-{100 * s['pair_ratio_max']:.0f} %"
    print(f"pairs' HTTP/offline {spread}; CPU per output token over HTTP (us): the server's "
          "busiest process (its engine's), the rest of the server, the load generator, and "
          "the busiest's share of the three")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", type=Path, default=HERE / "demo.yaml",
                   help="the Serve config to start (default bench/demo.yaml)")  # fmt: skip
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="every model's dtype, and the offline engine's (default: the config's, "
                   "auto resolved as the engine does)")  # fmt: skip
    p.add_argument("--pairs", type=int, default=3, help="HTTP / offline pairs (default 3)")
    p.add_argument("--concurrency", type=int, default=32,
                   help="streams over HTTP, requests at once offline (default 32)")  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--duration", type=float, default=40.0, help="seconds over HTTP per pair")
    p.add_argument("--stream-interval", type=int,
                   help="tokens per streamed chunk the HTTP requests ask for (default: the "
                   "server's, 1 unless the config's streamInterval says otherwise)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=5, help="offline runs per pair (the median)")
    p.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S,
                   help="seconds the server may take to be ready")  # fmt: skip
    p.add_argument("--settle", type=float, default=10.0,
                   help="seconds of quiet after the server stops")  # fmt: skip
    p.add_argument("--out", type=Path, default=default_out("http_vs_offline"))
    args = p.parse_args(argv)
    if not args.config.is_file():
        p.error(f"--config {args.config}: no such file")
    positive = (args.pairs, args.concurrency, args.prompt_len, args.output_len, args.repeats)
    if min(positive) < 1 or args.duration <= 0:
        p.error("--pairs, --concurrency, --prompt-len, --output-len, --repeats and --duration "
                "must be positive")  # fmt: skip
    if args.settle < 0 or args.start_timeout <= 0:
        p.error("--settle must be >= 0 and --start-timeout positive")
    if args.stream_interval is not None and args.stream_interval < 1:
        p.error("--stream-interval must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        run(parse_args(argv))
    except RuntimeError as exc:
        print(f"http_vs_offline: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
