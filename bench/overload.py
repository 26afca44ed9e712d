"""Overload benchmark: a server driven at several times the rate it can sustain.

    .venv/bin/python -m bench.overload                 # starts the demo server, maxLinkNum 32
    .venv/bin/python -m bench.overload --max-link-num 64 --factor 4 --duration 60
    .venv/bin/python -m bench.overload --url http://127.0.0.1:8000 --model demo  # a running one

Without --url it starts `python -m serve_app` (what `make serve` runs) on a copy of --config
(default bench/demo.yaml) that differs in `ServerConfig.maxLinkNum` and the port. Then:

1. capacity: --capacity-s of streaming /v1/completions at a fixed concurrency (maxLinkNum):
   the sustainable request rate and the latency of requests served at that load;
2. overload: --duration seconds of Poisson arrivals at --factor x that rate, no client-side
   limit on requests in flight. Every request ends as served (200, [DONE]), refused (503, or
   429 on Databricks paths, with Retry-After), another error, or hung (no answer within
   --timeout);
3. after: the server's /metrics (requests running and waiting, KV cache usage) once the load
   stops, and the resident memory of its replica processes (Ray's ServeReplica workers and the
   engine processes, on this machine) sampled before, during and after.

It prints a table and writes its JSON under bench/results/overload/ (docs/benchmarks.md has the
latest run).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from pathlib import Path

import httpx
import yaml

HERE = Path(__file__).resolve().parent

from bench import server_process  # noqa: E402
from bench.common import Run, default_out, log, machine_info, percentile_ms, random_token_ids  # noqa: E402
from bench.serve import Record, send, session  # noqa: E402  (bench/serve.py: one streamed request)
from bench.server_process import stop_server, wait_ready  # noqa: E402

ROOT = HERE.parent
REFUSED = ("HTTP 503", "HTTP 429")


# -- the server -----------------------------------------------------------------------------------


def start_server(config: Path, max_link_num: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`python -m serve_app` on a copy of `config` with maxLinkNum and a free port."""
    spec = yaml.safe_load(config.read_text())
    for app in spec["applications"]:
        server = app["args"].setdefault("ServerConfig", {})
        server["maxLinkNum"] = max_link_num
    return server_process.start_server(spec, log_path)


def _serve_deployment(proc) -> str | None:
    """The Serve deployment whose replica runs in this process (Ray's title:
    ...ServeReplica:<app>:<deployment>[.<method it runs now>]), else None."""
    cmd = " ".join(proc.info["cmdline"] or [])
    if "ServeReplica:" not in cmd:
        return None
    return cmd.split("ServeReplica:", 1)[1].split()[0].rsplit(":", 1)[-1].split(".")[0]


def _is_engine_process(proc) -> bool:
    """A model replica's engine process (engineProcess: true): the child of a Serve replica,
    not one of the same command that something else on this machine started (a test, a bench)."""
    import psutil

    if "host.process import _child_main" not in " ".join(proc.info["cmdline"] or []):
        return False
    try:
        parent = proc.parent()
        return parent is not None and "ServeReplica:" in " ".join(parent.cmdline())
    except psutil.Error:  # it or its parent ended meanwhile, or is not ours to read
        return False


def engine_processes() -> list:
    """The Serve model replicas' engine processes on this machine (psutil.Process)."""
    import psutil

    return [p for p in psutil.process_iter(["cmdline"]) if _is_engine_process(p)]


def replica_rss_mb(pids: Collection[int] | None = None) -> dict[str, float]:
    """Resident memory (MB) of the serving processes on this machine, by role; pids: of those
    processes only (another server on the same machine left out)."""
    import psutil

    roles: dict[str, float] = {}
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        if pids is not None and proc.pid not in pids:
            continue
        role = _serve_deployment(proc)
        if role is None and _is_engine_process(proc):
            role = "engine process"
        if role is not None and proc.info["memory_info"] is not None:
            roles[role] = roles.get(role, 0.0) + proc.info["memory_info"].rss / 2**20
    return roles


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


# -- the load -------------------------------------------------------------------------------------


class Bodies:
    def __init__(self, args, model: str) -> None:
        self.args, self.model = args, model
        self.rng = random.Random(args.seed)

    def next(self) -> dict:
        return {
            "model": self.model,
            "prompt": random_token_ids(self.rng, self.args.prompt_len, self.args.vocab_size),
            "max_tokens": self.args.output_len,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }


async def capacity(url: str, args, bodies: Bodies) -> tuple[list[Record], float]:
    """Closed loop at --concurrency for --capacity-s: (records, wall seconds)."""
    records: list[Record] = []
    stop_at = time.perf_counter() + args.capacity_s
    async with session() as client:

        async def worker() -> None:
            while time.perf_counter() < stop_at:
                records.append(await send(client, url, bodies.next(), args.timeout))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return records, time.perf_counter() - t0


async def overload(url: str, args, bodies: Bodies, rate: float, rss: list) -> list[Record]:
    """Poisson arrivals at `rate` for --duration, nothing held back on the client."""
    records: list[Record] = []
    arrivals = random.Random(f"{args.seed}:arrivals")
    async with session() as client:

        async def one(body: dict) -> None:
            records.append(await send(client, url, body, args.timeout))

        async def sample_rss(stop: asyncio.Event) -> None:
            while not stop.is_set():
                rss.append(await asyncio.to_thread(replica_rss_mb))
                try:
                    await asyncio.wait_for(stop.wait(), 2.0)
                except asyncio.TimeoutError:
                    pass

        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_rss(stop))
        tasks, t0 = [], time.perf_counter()
        due = t0
        while due < t0 + args.duration:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(one(bodies.next())))
            due += arrivals.expovariate(rate)
        await asyncio.gather(*tasks)
        stop.set()
        await sampler
    return records


# -- figures --------------------------------------------------------------------------------------


def latency(records: list[Record]) -> dict:
    ttft = [r.ttft for r in records if r.ttft is not None]
    e2e = [r.end - r.start for r in records]
    itl = [g for r in records for g in r.itls]
    return {
        "ttft_p50_ms": percentile_ms(ttft, 0.5), "ttft_p99_ms": percentile_ms(ttft, 0.99),
        "itl_p50_ms": percentile_ms(itl, 0.5), "itl_p99_ms": percentile_ms(itl, 0.99),
        "e2e_p50_ms": percentile_ms(e2e, 0.5), "e2e_p99_ms": percentile_ms(e2e, 0.99),
    }  # fmt: skip


def outcomes(records: list[Record]) -> dict:
    served = [r for r in records if r.error is None]
    refused = [r for r in records if r.error and r.error.startswith(REFUSED)]
    hung = [r for r in records if r.timed_out]
    other = [r for r in records if r.error and r not in refused and r not in hung]
    refused_ms = [(r.end - r.start) * 1e3 for r in refused]
    return {
        "requests": len(records),
        "served": len(served),
        "refused": len(refused),
        "hung": len(hung),
        "other_errors": len(other),
        "other_error_samples": sorted({r.error for r in other})[:5],
        "refused_p50_ms": percentile_ms([x / 1e3 for x in refused_ms], 0.5),
        "refused_max_ms": max(refused_ms) if refused_ms else None,
        "served_latency": latency(served),
    }


def print_report(result: dict) -> None:
    cap, over = result["capacity"], result["overload"]
    print(
        f"\ncapacity: {cap['requests_per_s']:.2f} req/s at concurrency {cap['concurrency']} "
        f"({cap['served']} served, {cap['errors']} errors)"
    )
    print(f"overload: {over['rate']:.2f} req/s offered ({result['factor']:g}x) for "
          f"{over['duration_s']:.0f} s: {over['requests']} requests")  # fmt: skip
    print(
        f"  served {over['served']}, refused {over['refused']} (p50 "
        f"{over['refused_p50_ms'] or float('nan'):.1f} ms, max "
        f"{over['refused_max_ms'] or float('nan'):.1f} ms), hung {over['hung']}, other errors "
        f"{over['other_errors']}"
    )
    print("\n| served requests | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | e2e p50 | e2e p99 |")
    print("|---|---|---|---|---|---|---|")
    for name, lat in (("at capacity", cap["latency"]), ("under overload", over["served_latency"])):
        keys = (
            "ttft_p50_ms",
            "ttft_p99_ms",
            "itl_p50_ms",
            "itl_p99_ms",
            "e2e_p50_ms",
            "e2e_p99_ms",
        )
        cells = ["-" if lat[k] is None else f"{lat[k]:.0f} ms" for k in keys]
        print(f"| {name} | " + " | ".join(cells) + " |")
    after = result["after"]
    print(
        f"\nafter: running {after['num_requests_running']:.0f}, waiting "
        f"{after['num_requests_waiting']:.0f}, KV cache usage {after['npu_cache_usage_perc']:.3f}"
    )
    rss = result["rss_mb"]
    for role in sorted(rss["before"]):
        print(
            f"RSS {role}: before {rss['before'][role]:.0f} MB, peak "
            f"{rss['peak'].get(role, 0):.0f} MB, after {rss['after'].get(role, 0):.0f} MB"
        )


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server's base URL (default: start one)")
    p.add_argument("--config", type=Path, default=ROOT / "bench" / "demo.yaml")
    p.add_argument("--max-link-num", type=int, default=32, help="maxLinkNum of the started server")
    p.add_argument("--model", help="model name (default: the server's first)")
    p.add_argument("--concurrency", type=int, help="capacity phase (default: --max-link-num)")
    p.add_argument("--capacity-s", type=float, default=30.0)
    p.add_argument("--factor", type=float, default=4.0, help="overload rate / capacity rate")
    p.add_argument("--duration", type=float, default=60.0, help="overload seconds")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--timeout", type=float, default=180.0, help="a request's limit: hung after")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=default_out("overload"))
    args = p.parse_args(argv)
    args.concurrency = args.concurrency or args.max_link_num
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run.begin(machine_info(("torch", "ray")))
    process = None
    url = args.url
    if url is None:
        server_log = Path(tempfile.mkdtemp(prefix="overload-")) / "server.log"
        log(
            f"starting the server ({args.config}, maxLinkNum {args.max_link_num}); log {server_log}"
        )
        process, url = start_server(args.config, args.max_link_num, server_log)
    try:
        wait_ready(url, args.ready_timeout, process)
        model = args.model or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        completions = f"{url}/v1/completions"
        bodies = Bodies(args, model)
        warm = argparse.Namespace(**{**vars(args), "capacity_s": 5.0})
        asyncio.run(capacity(completions, warm, bodies))  # warm-up
        rss_before = replica_rss_mb()
        log(f"capacity: concurrency {args.concurrency} for {args.capacity_s:.0f} s ...")
        records, wall = asyncio.run(capacity(completions, args, bodies))
        served = [r for r in records if r.error is None]
        cap_rate = len(served) / wall
        rate = args.factor * cap_rate
        log(
            f"capacity {cap_rate:.2f} req/s; overload at {rate:.2f} req/s for "
            f"{args.duration:.0f} s ..."
        )
        samples: list[dict] = []
        over = asyncio.run(overload(completions, args, bodies, rate, samples))
        time.sleep(5)  # aborted and finished requests settle
        after = scrape(url)
        rss_after = replica_rss_mb()
        peak: dict[str, float] = {}
        for sample in samples:
            for role, mb in sample.items():
                peak[role] = max(peak.get(role, 0.0), mb)
        result = {
            "url": url,
            "model": model,
            "max_link_num": args.max_link_num if args.url is None else None,
            "factor": args.factor,
            "workload": {"prompt_len": args.prompt_len, "output_len": args.output_len},
            "capacity": {
                "concurrency": args.concurrency,
                "wall_s": wall,
                "requests_per_s": cap_rate,
                "served": len(served),
                "errors": len(records) - len(served),
                "latency": latency(served),
            },  # fmt: skip
            "overload": {"rate": rate, "duration_s": args.duration, **outcomes(over)},
            "after": {
                key: after.get(key, float("nan"))
                for key in ("num_requests_running", "num_requests_waiting", "npu_cache_usage_perc")
            },
            "rss_mb": {"before": rss_before, "peak": peak, "after": rss_after},
        }
        print_report(result)
        run.write(args.out, **result)
    finally:
        if process is not None:
            stop_server(process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
