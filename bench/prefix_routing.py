"""Routing by prefix: a multi-turn chat workload over 2 and 4 model replicas, with the
prefix-aware router (serve_app.routing) against Ray Serve's default router.

    .venv/bin/python -m bench.prefix_routing                     # 2 and 4 replicas (~6 min)
    .venv/bin/python -m bench.prefix_routing --replicas 2 --conversations 8 --turns 3   # quick

One Ray instance (2 CPUs), one Serve HTTP proxy, one ingress replica; the app is deployed once
per (replica count, router) with the same model and limits, the model replicas sharing the
cores. The workload: `--conversations` chats run at once, each `--turns` turns long; every
conversation opens with the same system prompt (`--system` token ids) and its own first
question, and each turn sends the whole history so far (the earlier questions and the
answers the server gave) plus a new question, over MindIE's /infer_token (token ids in and
out, so the history is exact). Measured: each turn's time to first token (client side), and
the prefix cache's hit rate over the run (prompt blocks found in a replica's cache, from the
`prefix_cache_hits` and `prefix_cache_queries` counters of /metrics). The first turns, which no
router can place better, are left out of the TTFT figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from bench.common import (
    command_line,
    default_out,
    git_commit,
    loadavg,
    log,
    machine_info,
    percentile_ms,
    random_token_ids,
)
from bench.peers import free_port
from bench.server_process import wait_ready

APP = "serve_app_bench_prefix"
MODEL = "demo"
ROUTERS = {
    "prefix": None,  # the app's default
    "default": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
}
QUIET = {"log_level": "WARNING", "enable_access_log": False}


def app_args(replicas: int, router: str, args) -> dict:
    model_replica = {"num_replicas": replicas, "ray_actor_options": {"num_cpus": 0}}
    if ROUTERS[router]:
        model_replica["request_router_config"] = {"request_router_class": ROUTERS[router]}
    return {
        "BackendConfig": {
            "tokenizerProcessNumber": 1,
            "ModelDeployConfig": {
                "maxSeqLen": 4096,
                "maxInputTokenLen": 4096 - args.answer,
                "ModelConfig": [
                    {
                        "modelName": MODEL,
                        "modelWeightPath": args.model,
                        "dtype": "float32",
                        "engineProcess": False,
                        "engineCpus": "",
                        "engineSpareCpus": "",
                    }
                ],  # fmt: skip
            },
            "ScheduleConfig": {"kvCacheBlocks": args.kv_blocks, "maxIterTimes": args.answer},
        },
        "Deployments": {"ModelReplica": model_replica},
    }


async def turn(client: httpx.AsyncClient, history: list[int], answer: int) -> tuple[float, list]:
    """One turn: (seconds to the first token, the answer's token ids)."""
    body = {"input_id": history, "stream": True,
            "parameters": {"max_new_tokens": answer, "do_sample": False}}  # fmt: skip
    start, first, ids = time.perf_counter(), None, []
    async with client.stream("POST", "/infer_token", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(str(event)[:300])
            token = event.get("token")
            if token is not None:
                first = first or time.perf_counter()
                ids.append(token["id"])
    return (first or time.perf_counter()) - start, ids


async def conversations(url: str, args, seed: int) -> list[tuple[int, float]]:
    """(turn number, TTFT) of every turn of every conversation."""
    rng = random.Random(seed)
    system = random_token_ids(random.Random(0), args.system)
    out: list[tuple[int, float]] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)

    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:

        async def one(c: int) -> None:
            await asyncio.sleep(0.2 * c)  # the conversations start apart, as users do
            history = system + random_token_ids(rng, args.question)
            for t in range(args.turns):
                ttft, answer = await turn(client, history, args.answer)
                out.append((t, ttft))
                history = history + answer + random_token_ids(rng, args.question)

        await asyncio.gather(*(one(c) for c in range(args.conversations)))
    return out


def counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("prefix_cache_hits_total", "prefix_cache_queries_total"):
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


def bench_one(replicas: int, router: str, args, url: str) -> dict:
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app(app_args(replicas, router, args)), name=APP, route_prefix="/",
              logging_config=QUIET)  # fmt: skip
    try:
        wait_ready(url, 600, None, poll_s=0.5)
        asyncio.run(
            conversations(
                url,
                argparse.Namespace(**{**vars(args), "turns": 1, "conversations": replicas}),
                seed=999,
            )
        )  # fmt: skip  (warm-up)
        before = counters(url)
        started = time.perf_counter()
        turns = asyncio.run(conversations(url, args, seed=1))
        wall = time.perf_counter() - started
        after = counters(url)
    finally:
        serve.delete(APP)
        time.sleep(2.0)
    hits, queries = (
        after.get(f"prefix_cache_{k}_total", 0) - before.get(f"prefix_cache_{k}_total", 0)
        for k in ("hits", "queries")
    )
    later = [ttft for t, ttft in turns if t > 0]
    figures = {
        "replicas": replicas, "router": router, "turns": len(turns), "wall_s": round(wall, 2),
        "prefix_hit_rate": round(hits / queries, 3) if queries else None,
        "ttft_p50_ms": percentile_ms(later, 0.5), "ttft_p99_ms": percentile_ms(later, 0.99),
    }  # fmt: skip
    log(json.dumps(figures))
    return figures


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="modelWeightPath of the served model")
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=list(ROUTERS))
    p.add_argument("--conversations", type=int, default=16, help="chats at once")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system", type=int, default=64, help="shared system prompt, tokens")
    p.add_argument("--question", type=int, default=32, help="tokens of each new question")
    p.add_argument("--answer", type=int, default=32, help="tokens of each answer")
    p.add_argument("--kv-blocks", type=int, default=2048, help="KV blocks of each replica")
    p.add_argument("--out", help="result JSON (default bench/results/prefix_routing/...)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import ray
    from ray import serve

    args = parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    load_before = loadavg()
    results = []
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        serve.start(proxy_location="HeadOnly", logging_config=QUIET,
                    http_options={"host": "127.0.0.1", "port": port})  # fmt: skip
        for replicas in args.replicas:
            for router in args.routers:
                results.append(bench_one(replicas, router, args, url))
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"\n{'replicas':>8} {'router':>8} {'hit rate':>9} {'TTFT p50 ms':>12} {'p99 ms':>8}")
    for r in results:
        print(f"{r['replicas']:>8} {r['router']:>8} {r['prefix_hit_rate']!s:>9} "
              f"{r['ttft_p50_ms'] or 0:>12.1f} {r['ttft_p99_ms'] or 0:>8.1f}")  # fmt: skip
    out = default_out("prefix_routing") if args.out is None else args.out
    record = {
        "bench": "prefix_routing", "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
        "command": command_line(), "machine": machine_info(("ray", "torch")),
        "loadavg": {"before": load_before, "after": loadavg()}, "args": vars(args),
        "results": results,
    }  # fmt: skip
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
