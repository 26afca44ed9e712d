"""PD benchmark: colocated vs prefill/decode disaggregation under long-prompt interference.

    .venv/bin/python -m bench.pd                   # 60 s per mode, demo model, fp32 (~5 min)
    .venv/bin/python -m bench.pd --quick           # 20 s per mode (~2-3 min)
    .venv/bin/python -m bench.pd --model demo-tiny --duration 30

One Ray instance (2 CPUs), one Serve HTTP proxy; the app is deployed twice in turn with the same
model and limits: colocated (inferMode standard, one ModelReplica with num_cpus 2) and PD
(inferMode dmi, one PrefillReplica and one DecodeReplica with num_cpus 1 each). Against each,
the same mixed workload runs over HTTP: `--clients` loops of short requests back to back plus one
long prompt every `--long-every` seconds. TTFT and inter-token latency of the short requests are
measured client-side; the KV hand-off cost comes from /metrics. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent

from bench.common import (  # noqa: E402  (bench/common.py, next to this script)
    Run,
    default_out,
    gaps,
    loadavg,
    log,
    machine_info,
    percentile_ms,
    random_token_ids,
)
from bench.pd_report import print_report, ratios  # noqa: E402
from bench.peers import free_port  # noqa: E402
from bench.server_process import wait_ready  # noqa: E402
from serve_app.app import build_app  # noqa: E402

APP = "serve_app_bench_pd"
MODEL_NAME = "demo"  # the served name; --model picks the weights
MODES = {
    "colocated": "inferMode standard: 1 ModelReplica, num_cpus 2",
    "pd": "inferMode dmi: 1 PrefillReplica (num_cpus 1) + 1 DecodeReplica (num_cpus 1)",
}
# (figure key in the short-request summary, label) for the report's table
QUIET = {"log_level": "WARNING", "enable_access_log": False}  # no Serve log line per request


# -- the application ----------------------------------------------------------------------------


def app_args(mode: str, args) -> dict:
    """Application args of one mode: the same model and limits, only the topology differs."""
    if mode == "colocated":
        server = {"inferMode": "standard"}
        deployments = {"ModelReplica": {"ray_actor_options": {"num_cpus": 2}}}
    else:
        server = {"inferMode": "dmi"}
        deployments = {
            "Prefill": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}},
            "Decode": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}},
        }
    return {
        "ServerConfig": server,
        "BackendConfig": {
            "tokenizerProcessNumber": 1,
            "ModelDeployConfig": {
                "maxSeqLen": args.max_seq_len,
                "maxInputTokenLen": args.max_seq_len - args.max_iter,
                "ModelConfig": [
                    {"modelName": MODEL_NAME, "modelWeightPath": args.model, "dtype": args.dtype}
                ],
            },
            "ScheduleConfig": {
                "cacheBlockSize": args.block_size,
                "maxPrefillTokens": args.max_seq_len,
                "maxIterTimes": args.max_iter,
                "kvCacheBlocks": args.kv_blocks,
            },
        },
        "Deployments": deployments,
    }


def scrape(url: str) -> dict[str, float]:
    """/metrics as {sample name: value summed over every label set}; the PD TTFT stage
    histogram's _sum and _count are kept apart per stage (as "name:stage")."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if family.name == "pd_ttft_stage_seconds" and key.endswith(("_sum", "_count")):
                key = f"{key}:{sample.labels.get('stage')}"
            out[key] = out.get(key, 0.0) + sample.value
    return out


def diff(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


# -- the workload -------------------------------------------------------------------------------


@dataclass
class Record:
    kind: str  # "short" | "long" | "warmup" | "probe"
    start: float  # perf_counter when the request was sent
    prompt_tokens: int = 0
    token_times: list[float] = field(default_factory=list)  # perf_counter of each token event
    output_tokens: int | None = None  # what the server says it generated
    end: float = 0.0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    def token_gaps(self) -> list[float]:
        return gaps(self.token_times)


class Prompts:
    """Fresh prompts for every request (no prefix-cache hits across requests).

    infer_token: uniform random regular token ids of exactly the asked length. chat: random words
    from the first 5000 entries of the demo tokenizer's vocabulary, added until the text is at
    least `length` tokens long.
    """

    def __init__(self, api: str, seed: int, model_path: Path | None) -> None:
        self.api = api
        self.rng = random.Random(seed)
        self.tokenizer = None
        self.words: list[str] = []
        if api == "chat":
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
            words = [w.strip() for w in self.tokenizer.batch_decode([[i] for i in range(5000)])]
            self.words = [w for w in words if len(w) > 2 and w.isascii() and w.isalpha()]

    def make(self, length: int):
        if self.api == "infer_token":
            return random_token_ids(self.rng, length)
        words: list[str] = []
        while len(self.tokenizer.encode(" ".join(words))) < length:
            words += self.rng.sample(self.words, max(1, (length - len(words)) // 2))
        return " ".join(words)


def request_body(api: str, prompt, max_tokens: int) -> tuple[str, dict]:
    if api == "infer_token":
        params = {"max_new_tokens": max_tokens, "do_sample": False, "details": True}
        return "/infer_token", {"input_id": prompt, "stream": True, "parameters": params}
    return "/v1/chat/completions", {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "top_k": 1,  # greedy (chat has no do_sample; temperature must be > 0)
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def note_event(rec: Record, api: str, event: dict, now: float) -> None:
    """One streamed event of rec's request: a token's arrival time, and the server's counts."""
    if api == "infer_token":
        if event.get("token") is not None:
            rec.token_times.append(now)
        if event.get("details"):
            rec.output_tokens = event["details"].get("generated_tokens")
        return
    if event.get("usage"):
        rec.prompt_tokens = event["usage"]["prompt_tokens"]
        rec.output_tokens = event["usage"]["completion_tokens"]
    choices = event.get("choices") or []
    if choices and choices[0].get("delta", {}).get("content"):
        rec.token_times.append(now)


async def send(client: httpx.AsyncClient, api: str, kind: str, prompt, max_tokens: int) -> Record:
    path, body = request_body(api, prompt, max_tokens)
    rec = Record(kind, time.perf_counter(), len(prompt) if api == "infer_token" else 0)
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                rec.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return rec
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now, data = time.perf_counter(), line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    rec.error = str(event)[:300]
                    break
                note_event(rec, api, event, now)
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        rec.end = time.perf_counter()
    return rec


async def workload(url: str, args, prompts: Prompts) -> tuple[list[Record], float, float]:
    """Short chats back to back on `clients` loops plus long prompts on a fixed schedule, for
    `duration` seconds; requests sent in the window are awaited to the end (drain)."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    timeout = httpx.Timeout(600.0)
    records: list[Record] = []
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()
        stop = t0 + args.duration

        async def short_loop(i: int) -> None:
            await asyncio.sleep(0.25 * i)  # de-phase the loops
            while time.perf_counter() < stop:
                prompt = prompts.make(args.short_len)
                records.append(await send(client, args.api, "short", prompt, args.short_out))

        async def long_schedule() -> None:
            tasks = []
            k = 0
            while True:
                due = t0 + args.long_every * (k + 0.5)
                if due >= stop:
                    break
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                prompt = prompts.make(args.long_len)
                tasks.append(
                    asyncio.create_task(send(client, args.api, "long", prompt, args.long_out))
                )
                k += 1
            records.extend(await asyncio.gather(*tasks))

        await asyncio.gather(long_schedule(), *(short_loop(i) for i in range(args.clients)))
        t_end = time.perf_counter()
    return records, t0, t_end


async def warmup(url: str, args, prompts: Prompts) -> list[Record]:
    """A few of each request kind, alone and together, before anything is measured."""
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        out = [await send(client, args.api, "warmup", prompts.make(args.short_len), 4)]
        out.append(await send(client, args.api, "warmup", prompts.make(args.long_len), 2))
        out += await asyncio.gather(
            send(client, args.api, "warmup", prompts.make(args.long_len), 2),
            *(
                send(client, args.api, "warmup", prompts.make(args.short_len), args.short_out)
                for _ in range(args.clients)
            ),
        )
    return out


async def handoff_probes(url: str, args, prompts: Prompts) -> list[dict]:
    """Requests sent one at a time on the idle PD app, /metrics read around each: the hand-off
    seconds and bytes of exactly that request."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        for length in (args.short_len, args.long_len):
            for _ in range(args.probes):
                before = await asyncio.to_thread(scrape, url)
                rec = await send(client, args.api, "probe", prompts.make(length), 2)
                after = await asyncio.to_thread(scrape, url)
                out.append(
                    {
                        "prompt_tokens": rec.prompt_tokens,
                        "error": rec.error,
                        "handoffs": diff(after, before, "kv_handoff_seconds_count"),
                        "handoff_s": diff(after, before, "kv_handoff_seconds_sum"),
                        "bytes": diff(after, before, "kv_transfer_bytes_total"),
                        "ttft_s": rec.ttft,
                    }
                )
    return out


# -- summaries ----------------------------------------------------------------------------------


def ttft_split(shorts: list[Record], records: list[Record]) -> dict:
    """Short-request TTFT split by whether a long prompt was in flight while it waited."""
    spans = [(r.start, r.end) for r in records if r.kind == "long"]
    hit, clear = [], []
    for r in shorts:
        if r.ttft is not None:
            busy = any(a < r.token_times[0] and r.start < b for a, b in spans)
            (hit if busy else clear).append(r.ttft)
    return {
        "long_in_flight": {"requests": len(hit), "p50_ms": percentile_ms(hit, 0.5)},
        "no_long_in_flight": {"requests": len(clear), "p50_ms": percentile_ms(clear, 0.5)},
    }


def short_figures(shorts: list[Record], t0: float, records: list[Record]) -> dict:
    """The short requests' TTFT, inter-token latency and throughput."""
    ttfts = [r.ttft for r in shorts if r.ttft is not None]
    itl = [g for r in shorts for g in r.token_gaps()]
    later = [g for r in shorts for g in r.token_gaps()[1:]]  # without the first->second gap
    tokens = sum(len(r.token_times) for r in shorts)
    window = (max(r.end for r in shorts) - t0) if shorts else float("nan")
    figures = {
        "requests": len(shorts),
        "token_events": tokens,
        "token_events_per_request": sorted({len(r.token_times) for r in shorts}),
        "generated_tokens_per_request": sorted(
            {r.output_tokens for r in shorts if r.output_tokens is not None}
        ),
        "prompt_tokens_per_request": sorted({r.prompt_tokens for r in shorts}),
        "ttft_p50_ms": percentile_ms(ttfts, 0.5),
        "ttft_p99_ms": percentile_ms(ttfts, 0.99),
        "ttft_max_ms": 1e3 * max(ttfts) if ttfts else None,
        "itl_samples": len(itl),
        "itl_p50_ms": percentile_ms(itl, 0.5),
        "itl_p90_ms": percentile_ms(itl, 0.9),
        "itl_p99_ms": percentile_ms(itl, 0.99),
        "itl_max_ms": 1e3 * max(itl) if itl else None,
        "itl_after_second_token_p50_ms": percentile_ms(later, 0.5),
        "itl_after_second_token_p99_ms": percentile_ms(later, 0.99),
        "window_s": window,
        "tokens_per_s": tokens / window if shorts else None,
        "requests_per_s": len(shorts) / window if shorts else None,
    }
    if ttfts:
        figures["ttft_mean_ms"] = 1e3 * statistics.fmean(ttfts)
    figures["ttft_split"] = ttft_split(shorts, records)
    return figures


def summarize_records(records: list[Record], t0: float, t_end: float) -> dict:
    """The measured window's figures: short requests, long ones, errors, overall throughput."""
    shorts = [r for r in records if r.kind == "short" and r.error is None]
    longs = [r for r in records if r.kind == "long" and r.error is None]
    errors = [r.error for r in records if r.error is not None]
    return {
        "short": short_figures(shorts, t0, records),
        "long": {
            "requests": len(longs),
            "prompt_tokens": [r.prompt_tokens for r in longs],
            "ttft_ms": [round(1e3 * r.ttft, 1) for r in longs if r.ttft is not None],
            "e2e_ms": [round(1e3 * (r.end - r.start), 1) for r in longs],
            "output_tokens": [r.output_tokens for r in longs],
        },
        "errors": len(errors),
        "error_samples": errors[:5],
        "wall_s": t_end - t0,
        "total_output_tokens_per_s": sum(len(r.token_times) for r in shorts + longs) / (t_end - t0),
    }


def pd_metrics(before: dict, after: dict, records: list[Record]) -> dict:
    """The PD run's hand-off figures from /metrics (diffed around the measured workload)."""
    count = diff(after, before, "kv_handoff_seconds_count")
    seconds = diff(after, before, "kv_handoff_seconds_sum")
    nbytes = diff(after, before, "kv_transfer_bytes_total")
    done = [r for r in records if r.error is None and len(r.token_times) >= 2]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    stages = {}
    for stage in ("queue", "prefill", "handoff", "first_decode_step"):
        n = diff(after, before, f"pd_ttft_stage_seconds_count:{stage}")
        s = diff(after, before, f"pd_ttft_stage_seconds_sum:{stage}")
        stages[stage] = {"count": n, "mean_ms": 1e3 * s / n if n else None}
    return {
        "handoffs": count,
        "handoff_seconds_sum": seconds,
        "handoff_mean_ms": 1e3 * seconds / count if count else None,
        "kv_transfer_bytes": nbytes,
        "kv_recomputed": diff(after, before, "kv_recomputed_total"),
        "requests_handed_off_client_side": len(done),
        "prompt_tokens_handed_off": prompt_tokens,
        "handoff_ms_per_1k_prompt_tokens": (
            1e6 * seconds / prompt_tokens if prompt_tokens else None
        ),
        "kv_bytes_per_prompt_token": nbytes / prompt_tokens if prompt_tokens else None,
        "ttft_stages": stages,
    }


def probe_summary(probes: list[dict], args) -> dict:
    limit = (args.short_len + args.long_len) / 2

    def group(kind: str) -> list[dict]:
        ok = [p for p in probes if p["error"] is None and p["handoffs"] == 1]
        return [p for p in ok if (p["prompt_tokens"] >= limit) == (kind == "long")]

    out: dict = {"probes": probes}
    for kind in ("short", "long"):
        g = group(kind)
        if g:
            out[kind] = {
                "prompt_tokens": statistics.fmean(p["prompt_tokens"] for p in g),
                "handoff_ms_median": 1e3 * statistics.median(p["handoff_s"] for p in g),
                "bytes_median": statistics.median(p["bytes"] for p in g),
            }
    if "long" in out:
        long = out["long"]
        long["handoff_ms_per_1k_tokens"] = 1e3 * long["handoff_ms_median"] / long["prompt_tokens"]
        long["kv_mb_per_1k_tokens"] = long["bytes_median"] / long["prompt_tokens"] / 1e3
    if "long" in out and "short" in out:
        dt = out["long"]["handoff_ms_median"] - out["short"]["handoff_ms_median"]
        dn = out["long"]["prompt_tokens"] - out["short"]["prompt_tokens"]
        out["marginal_ms_per_1k_tokens"] = 1e3 * dt / dn if dn else None
    return out


# -- one mode -----------------------------------------------------------------------------------


def bench_mode(mode: str, args, url: str, prompts: Prompts) -> dict:
    from ray import serve

    log(f"{mode}: deploying ({MODES[mode]}) ...")
    start = time.monotonic()
    serve.run(build_app(app_args(mode, args)), name=APP, route_prefix="/", logging_config=QUIET)
    wait_ready(url, args.ready_timeout, None, poll_s=0.5)
    ready_s = time.monotonic() - start
    log(f"{mode}: ready in {ready_s:.1f} s; warm-up ...")
    try:
        warm = asyncio.run(warmup(url, args, prompts))
        bad = [r.error for r in warm if r.error]
        if bad:
            raise RuntimeError(f"{mode}: warm-up requests failed: {bad[:3]}")
        time.sleep(1.0)
        before = scrape(url)
        load_start = loadavg()
        log(
            f"{mode}: {args.duration:.0f} s of {args.clients} short-chat loops + a "
            f"{args.long_len}-token prompt every {args.long_every:g} s ..."
        )
        records, t0, t_end = asyncio.run(workload(url, args, prompts))
        after = scrape(url)
        result = {"topology": MODES[mode], "ready_s": ready_s, "loadavg_start": load_start}
        result.update(summarize_records(records, t0, t_end))
        result["loadavg_end"] = loadavg()
        s = result["short"]
        log(
            f"{mode}: {s['requests']} short chats, {result['long']['requests']} long prompts, "
            f"{result['errors']} errors; ITL p99 {s['itl_p99_ms'] or float('nan'):.1f} ms, "
            f"TTFT p99 {s['ttft_p99_ms'] or float('nan'):.1f} ms"
        )
        if mode == "pd":
            result["kv_handoff"] = pd_metrics(before, after, records)
            log(f"{mode}: hand-off probes ({args.probes} short + {args.probes} long, alone) ...")
            result["kv_handoff_probes"] = probe_summary(
                asyncio.run(handoff_probes(url, args, prompts)), args
            )
    finally:
        serve.delete(APP)
        time.sleep(2.0)  # let the replicas' processes go before the next mode
    return result


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", choices=["demo", "demo-tiny"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    parser.add_argument(
        "--api",
        default="infer_token",
        choices=["infer_token", "chat"],
        help="infer_token (default): streaming /infer_token, exact prompt lengths, one SSE event"
        " per token; chat: streaming /v1/chat/completions with ignore_eos and include_usage",
    )
    parser.add_argument("--modes", nargs="+", default=["colocated", "pd"], choices=list(MODES))
    parser.add_argument("--duration", type=float, default=None, help="seconds per mode (60; 20)")
    parser.add_argument("--clients", type=int, default=3, help="short-chat loops")
    parser.add_argument("--short-len", type=int, default=30, help="short prompt tokens")
    parser.add_argument("--short-out", type=int, default=32, help="short output tokens")
    parser.add_argument("--long-len", type=int, default=1500, help="long prompt tokens")
    parser.add_argument("--long-out", type=int, default=8, help="long output tokens")
    parser.add_argument("--long-every", type=float, default=4.0, help="seconds between longs")
    parser.add_argument("--max-seq-len", type=int, default=4096, help="maxSeqLen (demo: 4096)")
    parser.add_argument("--max-iter", type=int, default=64, help="maxIterTimes")
    parser.add_argument("--block-size", type=int, default=128, help="cacheBlockSize (16-128)")
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="kvCacheBlocks (default: room for 8 sequences of maxSeqLen)",
    )
    parser.add_argument("--probes", type=int, default=3, help="PD hand-off probes per length")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="20 s per mode")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON result (default bench/results/pd/<machine kind>/<date>.json, labelled -quick "
        "with --quick)",
    )
    args = parser.parse_args(argv)
    if args.duration is None:
        args.duration = 20.0 if args.quick else 60.0
    if not 16 <= args.block_size <= 128:
        parser.error("--block-size must be in [16, 128]")
    if args.long_len + args.long_out > args.max_seq_len or args.long_out > args.max_iter:
        parser.error("the long prompt and its output must fit --max-seq-len / --max-iter")
    if args.short_out < 2:
        parser.error("--short-out must be >= 2 (inter-token latency needs two tokens)")
    if args.kv_blocks is None:
        args.kv_blocks = 8 * -(-args.max_seq_len // args.block_size)
    if args.out is None:
        args.out = default_out("pd", "quick" if args.quick else "")
    return args


def print_header(args, run: Run) -> None:
    machine = run.machine
    print(
        f"workload: {args.clients} short-chat loops ({args.short_len}-token prompts x "
        f"{args.short_out} tokens) + one {args.long_len}-token prompt x {args.long_out} tokens "
        f"every {args.long_every:g} s, {args.duration:g} s per mode, greedy, via {args.api}"
    )
    print(
        f"model {args.model} ({args.dtype}), maxSeqLen {args.max_seq_len}, cacheBlockSize "
        f"{args.block_size}, kvCacheBlocks {args.kv_blocks}; machine: {machine['cpu_model']}, "
        f"{machine['cpus_usable']} usable CPUs; loadavg {run.loadavg_start}"
    )


def run_modes(args, prompts: Prompts) -> dict[str, dict]:
    """Start Ray and a Serve proxy, benchmark each mode in turn, then shut both down."""
    import ray
    from ray import serve

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    results: dict[str, dict] = {}
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        http = {"host": "127.0.0.1", "port": port}
        serve.start(proxy_location="HeadOnly", http_options=http, logging_config=QUIET)
        for mode in args.modes:
            results[mode] = bench_mode(mode, args, url, prompts)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return results


def workload_record(args) -> dict:
    """The workload as the JSON result describes it."""
    return {
        "api": args.api,
        "clients": args.clients,
        "short": f"{args.short_len}-token prompts x {args.short_out} output tokens, looped",
        "long": f"{args.long_len}-token prompt x {args.long_out} output tokens "
        f"every {args.long_every:g} s (first at {args.long_every / 2:g} s)",
        "duration_s": args.duration,
        "prompts": (
            f"fresh per request: uniform random regular token ids, random.Random({args.seed})"
            if args.api == "infer_token"
            else f"fresh per request: random demo-tokenizer words, random.Random({args.seed})"
        ),
        "sampling": "greedy"
        + (", ignore_eos" if args.api == "chat" else " (the demo model emits no EOS)"),
        "quick": args.quick,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from serve_app.models.demo import ensure_demo_model

    run = Run.begin(machine_info(("torch", "ray", "transformers", "httpx")))
    print_header(args, run)
    model_path = ensure_demo_model(args.model)  # built once here, not inside a replica
    prompts = Prompts(args.api, args.seed, model_path)
    results = run_modes(args, prompts)
    rat = ratios(results)
    print_report(results, rat)
    run.write(
        args.out,
        workload=workload_record(args),
        app_args={mode: app_args(mode, args) for mode in args.modes},
        results=results,
        ratios=rat,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
