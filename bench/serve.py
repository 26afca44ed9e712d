"""Serving load generator: streams requests at any OpenAI-compatible server and sweeps the load.

    # our server (`make serve CONFIG=bench/demo.yaml`: the model `demo` at 127.0.0.1:8000/v1)
    .venv/bin/python -m bench.serve --target ours=http://127.0.0.1:8000/v1 \\
        --prompt-len uniform:64:256 --output-len 128 --ignore-eos --concurrency 1,4,16

    # ours started and stopped by the bench from a Serve config, then vLLM's CPU build on the
    # same weights: each server measured with the machine to itself
    .venv/bin/python -m bench.serve --serve bench/demo.yaml --peers vllm --token-ids --ignore-eos

    # ours against a vLLM server on port 8001 (same model weights), one line per system
    .venv/bin/python -m bench.serve --target ours=http://127.0.0.1:8000/v1 \\
        --target vllm=http://127.0.0.1:8001/v1 --model demo --api chat --ignore-eos

Every request streams (`stream: true`); per request it records the time to the first chunk
with text (TTFT), the gaps between chunks with text (ITL), the end-to-end time, the output tokens
(the server's `usage` when sent, else the number of text chunks) and any error (HTTP status,
error event, exception, per-request timeout). Per target and per load level (a concurrency, or a
Poisson request rate with `--rate`) it reports throughput and latency percentiles, prints a
table, writes a JSON result and, with matplotlib, PNG plots. It contacts only the given URLs,
our server that `--serve` starts from a Serve config (and stops before anything else runs), and
the peers `--peers` starts (bench/peers.py: vLLM's CPU build, `transformers serve`) on the same
weights folder, one after the other, after the targets; the table then gives each target's
throughput as a ratio to each peer's at every level. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent

from bench.common import (  # noqa: E402  (bench/common.py, next to this script)
    VOCAB_REGULAR,
    Run,
    default_out,
    gaps,
    log,
    machine_info,
    random_token_ids,
)
from bench.peers import REFUSES, Peer, PeerUnavailable, parse_peers  # noqa: E402
from bench.proc_cpu import TreeCPU  # noqa: E402
from bench.serve_report import plot, print_table, summarize  # noqa: E402
from bench.server_process import (  # noqa: E402
    START_TIMEOUT_S,
    first_model,
    resolved_dtype,
    server_command,
    start_server,
    stop_server,
    wait_ready,
)
from bench.sse_client import HTTPStatusError, StreamClient  # noqa: E402

try:  # parses a chunk's JSON ~5x faster than json; strict, so json takes what it refuses
    from orjson import loads as _fast_loads
except ImportError:
    _fast_loads = json.loads

DEFAULT_TARGET = "ours=http://127.0.0.1:8000/v1"
DEFAULT_CONCURRENCY = "1,4,16,32,64"
SERVED_NAME = "ours"  # the target --serve starts
SETTLE_S = 5.0  # quiet after the --serve server stopped, before the next target or peer
# Common English words: with a leading space each is one token in the usual BPE vocabularies,
# so a text prompt of N words is about N tokens for any server (no tokenizer needed here).
WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force"
).split()
# Keys a --workload JSON file may set: the workload flags' names (dashes or underscores).
WORKLOAD_KEYS = {
    "api", "prompt_len", "output_len", "token_ids", "vocab_size", "rate", "concurrency",
    "max_concurrency", "duration", "num_requests", "seed", "ignore_eos", "temperature",
    "timeout", "warmup", "stream_interval",
}  # fmt: skip


# -- lengths and prompts ------------------------------------------------------------------------


@dataclass(frozen=True)
class Length:
    """A token count: fixed, uniform in [a, b], or normal(a, b) rounded and clipped to >= 1."""

    kind: str
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"normal:{self.a:g}:{self.b:g}"


def parse_length(spec: str | int) -> Length:
    """`128`, `uniform:64:256` (both ends included) or `normal:MEAN:STD`."""
    parts = str(spec).strip().split(":")
    try:
        if len(parts) == 1 and int(parts[0]) >= 1:
            return Length("fixed", int(parts[0]))
        if len(parts) == 3 and parts[0] == "uniform":
            lo, hi = int(parts[1]), int(parts[2])
            if 1 <= lo <= hi:
                return Length("uniform", lo, hi)
        if len(parts) == 3 and parts[0] == "normal":
            mean, std = float(parts[1]), float(parts[2])
            if mean >= 1 and std >= 0:
                return Length("normal", mean, std)
    except ValueError:
        pass
    raise ValueError(f"bad length {spec!r}: want N >= 1, uniform:LO:HI or normal:MEAN:STD")


def make_prompt(rng: random.Random, args, length: int) -> str | list[int]:
    """Token ids for completions with --token-ids (exact length), else random words."""
    if args.api == "completions" and args.token_ids:
        return random_token_ids(rng, length, args.vocab_size)
    return " ".join(rng.choice(WORDS) for _ in range(length))


def request_body(args, model: str, prompt: str | list[int], max_tokens: int) -> tuple[str, dict]:
    """(path under the base URL, JSON body) of one streaming request."""
    body: dict = {"model": model, "max_tokens": max_tokens, "stream": True}
    # Asked for on both APIs: vLLM then ends a completions stream with a usage chunk as well
    # (ours always puts usage on the last completions event).
    body["stream_options"] = {"include_usage": True}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.stream_interval is not None:  # vLLM's extension, which ours takes too
        body["stream_interval"] = args.stream_interval
    if args.api == "completions":
        body["prompt"] = prompt
        body["temperature"] = args.temperature
        return "/completions", body
    body["messages"] = [{"role": "user", "content": prompt}]
    if args.temperature > 0:
        body["temperature"] = args.temperature
    else:  # our chat route takes temperature in (0, 2] (as MindIE); top_k 1 is greedy anywhere
        body["top_k"] = 1
    return "/chat/completions", body


# -- one request --------------------------------------------------------------------------------


@dataclass
class Record:
    """One request as the client saw it (perf_counter seconds)."""

    start: float
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrivals of chunks with text
    output_tokens: int | None = None  # the server's usage.completion_tokens, when sent
    prompt_tokens: int | None = None
    done: bool = False  # [DONE] seen
    error: str | None = None
    timed_out: bool = False

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def itls(self) -> list[float]:
        # A chunk may carry several tokens (a server batching its output, or text held back
        # until it is valid UTF-8): that is one gap here, not several.
        return gaps(self.token_times)

    @property
    def tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.token_times)


def chunk_has_text(choice: dict) -> bool:
    """completions chunks carry `text`, chat chunks `delta.content` (a role-only delta has none)."""
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


def note_line(rec: Record, line: str, now: float) -> bool:
    """Take one SSE line of rec's stream at time `now`; True once the stream is over."""
    if not line.startswith("data:"):
        return False  # blank separators, comments, `event:` lines
    data = line[5:].strip()
    if data == "[DONE]":
        rec.done = True
        return True
    try:
        event = _fast_loads(data)
    except ValueError:  # NaN / Infinity, which json reads
        event = json.loads(data)
    if event.get("error"):
        rec.error = f"error event: {json.dumps(event['error'])[:300]}"
        return True
    usage = event.get("usage")
    if usage:
        rec.output_tokens = usage.get("completion_tokens")
        rec.prompt_tokens = usage.get("prompt_tokens")
    if any(chunk_has_text(c) for c in event.get("choices") or []):
        rec.token_times.append(now)
    return False


def session() -> StreamClient:
    """The HTTP client of every request of a run (`async with`): bench/sse_client.py, keep-alive
    connections over httptools' parser, about half aiohttp's CPU per streamed chunk (and aiohttp
    half httpx's), so that a load generator on the server's own cores takes less from it."""
    return StreamClient()


async def _stream(client: StreamClient, url: str, body: dict, rec: Record) -> None:
    try:
        await client.post_lines(url, body, lambda line, now: note_line(rec, line, now))
    except HTTPStatusError as exc:
        rec.error = str(exc)
        return
    if rec.error is None and not rec.done:
        rec.error = "stream ended without [DONE]"


async def send(client: StreamClient, url: str, body: dict, timeout_s: float) -> Record:
    """One streaming request, bounded by timeout_s in all (connect, queueing, generation)."""
    rec = Record(time.perf_counter())
    try:
        await asyncio.wait_for(_stream(client, url, body, rec), timeout_s)
    except asyncio.TimeoutError:
        rec.error, rec.timed_out = f"timeout after {timeout_s:g} s", True
    except (OSError, ValueError) as exc:  # ValueError: a body not JSON
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    rec.end = time.perf_counter()
    return rec


# -- one load level -----------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str | None = None
    server_pids: list[int] = field(default_factory=list)  # whose CPU a level measures (+ tree)
    spec: dict | None = None  # --serve: the Serve config this bench starts our server from


class Progress:
    """A tqdm bar per level when tqdm is installed, else a plain line every quarter."""

    def __init__(self, desc: str, total: int | None, enabled: bool) -> None:
        self.desc, self.total, self.count, self.errors = desc, total, 0, 0
        self.bar = None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="req", leave=False)
            except ImportError:
                log(f"{desc}: started")

    def update(self, rec: Record) -> None:
        self.count += 1
        self.errors += rec.error is not None
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(errors=self.errors, refresh=False)
        elif self.enabled and self.total and self.count % max(1, self.total // 4) == 0:
            log(f"{self.desc}: {self.count}/{self.total} requests, {self.errors} errors")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Requests:
    """The level's requests in order, from a generator seeded by (seed, level): every target
    gets the same sequence. Stops at the request count or the level's stop time."""

    def __init__(self, args, model: str, level: float, stop_at: float) -> None:
        self.args, self.model, self.stop_at = args, model, stop_at
        self.rng = random.Random(f"{args.seed}:{level}")
        self.limit = requests_per_level(args, level)
        self.issued = 0

    def more(self) -> bool:
        count_left = self.limit is None or self.issued < self.limit
        return count_left and time.perf_counter() < self.stop_at

    def next(self) -> tuple[str, dict] | None:
        if not self.more():
            return None
        self.issued += 1
        prompt = make_prompt(self.rng, self.args, self.args.prompt_len.sample(self.rng))
        return request_body(self.args, self.model, prompt, self.args.output_len.sample(self.rng))


def requests_per_level(args, level: float) -> int | None:
    """--num-requests; without it and without --duration, 4 x the level (at least 16)."""
    if args.num_requests is not None:
        return args.num_requests
    if args.duration is not None:
        return None
    return max(16, math.ceil(4 * level))


async def closed_loop(client, target: Target, reqs: Requests, level: int, on_done) -> None:
    """Fixed concurrency: `level` workers, each sending its next request when one finishes."""

    async def worker() -> None:
        while (item := reqs.next()) is not None:
            path, body = item
            on_done(await send(client, target.base_url + path, body, reqs.args.timeout))

    await asyncio.gather(*(worker() for _ in range(level)))


async def open_loop(client, target: Target, reqs: Requests, rate: float, on_done) -> None:
    """Poisson arrivals at `rate` req/s, at most --max-concurrency in flight."""
    arrivals = random.Random(f"{reqs.args.seed}:{rate}:arrivals")
    slots = asyncio.Semaphore(reqs.args.max_concurrency)

    async def one(path: str, body: dict) -> None:
        async with slots:
            on_done(await send(client, target.base_url + path, body, reqs.args.timeout))

    tasks, due = [], time.perf_counter()
    while (item := reqs.next()) is not None:
        tasks.append(asyncio.create_task(one(*item)))
        if not reqs.more():  # the last one: no wait for an arrival that will not come
            break
        due += arrivals.expovariate(rate)
        await asyncio.sleep(max(0.0, min(due, reqs.stop_at) - time.perf_counter()))
    await asyncio.gather(*tasks)


async def run_level(client, target: Target, args, level: float, deadline: float) -> dict:
    """Every request of one level against one target, then its figures."""
    t0 = time.perf_counter()
    stop_at = min(deadline, t0 + args.duration if args.duration is not None else math.inf)
    reqs = Requests(args, target.model, level, stop_at)
    label = f"rate {level:g}/s" if args.rate else f"concurrency {int(level)}"
    server = TreeCPU(target.server_pids) if target.server_pids else None
    server_before = server.snapshot() if server else None
    client_before = time.process_time()
    progress = Progress(f"{target.name} {label}", reqs.limit, args.progress)
    records: list[Record] = []

    def on_done(rec: Record) -> None:
        records.append(rec)
        progress.update(rec)

    try:
        with batch_scheduled(args.sched == "batch"):
            if args.rate:
                await open_loop(client, target, reqs, level, on_done)
            else:
                await closed_loop(client, target, reqs, int(level), on_done)
    finally:
        progress.close()
    fig = summarize(records, time.perf_counter() - t0, level)
    spent = TreeCPU.spent(server_before, server.snapshot()) if server else None
    return {**fig, **cpu_figures(time.process_time() - client_before, spent, fig["output_tokens"])}


@contextlib.contextmanager
def batch_scheduled(enabled: bool):
    """This thread (the event loop's) at Linux's SCHED_BATCH while the block runs, then back.

    A load generator on the server's own cores is woken by every chunk it waits for; at the
    normal policy each wake-up preempts the server process that wrote the chunk, which then
    writes the next one only after the load generator went back to sleep: a pair of context
    switches per streamed chunk that a client on another machine never causes. A SCHED_BATCH
    task does not preempt on wake-up, so it reads the chunks of a whole engine step in one go
    after the server yields the core. Elsewhere (or where the policy cannot be set): nothing."""
    before = None
    if enabled and hasattr(os, "SCHED_BATCH"):
        try:
            policy = os.sched_getscheduler(0), os.sched_getparam(0)
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            before = policy
        except OSError:
            pass
    try:
        yield
    finally:
        if before is not None:
            os.sched_setscheduler(0, *before)


def cpu_figures(client_s: float, server: dict[str, float] | None, tokens: int) -> dict:
    """CPU seconds of the load generator (this process) and, when measured, of the server's
    processes per label, with both per output token."""
    per_token = (lambda s: 1e6 * s / tokens) if tokens else (lambda s: None)
    out = {"client_cpu_s": client_s, "client_cpu_us_per_token": per_token(client_s)}
    if server is not None:
        total = sum(server.values())
        out.update(server_cpu_s=total, server_cpu_us_per_token=per_token(total),
                   server_cpu_by_process_s=server)  # fmt: skip
    return out


# -- the run ------------------------------------------------------------------------------------


async def discover_model(client: StreamClient, target: Target) -> str:
    """The first model `GET {base}/models` lists."""
    data = (await client.get_json(target.base_url + "/models")).get("data") or []
    if not data:
        raise RuntimeError(f"{target.name}: {target.base_url}/models lists no model")
    return data[0]["id"]


async def resolve_model(client: StreamClient, target: Target, args) -> str | None:
    """Set target.model (--model, else the server's first); the error text when that fails."""
    try:
        target.model = (
            target.model
            or args.model
            or await asyncio.wait_for(discover_model(client, target), args.timeout)
        )
    except (
        HTTPStatusError,
        OSError,
        asyncio.TimeoutError,
        RuntimeError,
        ValueError,
        KeyError,
    ) as exc:
        log(f"{target.name}: no model from {target.base_url}/models ({exc}); skipped")
        return f"{type(exc).__name__}: {exc}"
    return None


async def bench_target(target: Target, args, deadline: float) -> dict:
    """Warm-up, then every level in turn (those past the overall limit are skipped)."""
    async with session() as client:
        error = await resolve_model(client, target, args)
        if error is not None:  # one unreachable target must not cost the others their results
            skipped = list(args.levels)
            return {"url": target.base_url, "model": None, "levels": [], "skipped": skipped,
                    "error": error}  # fmt: skip
        warm = Requests(args, target.model, -1, deadline)  # its own seed: not a measured prompt
        for _ in range(args.warmup):
            path, body = warm.next() or request_body(args, target.model, "hello", 2)
            await send(client, target.base_url + path, body, args.timeout)
        levels, skipped = [], []
        for level in args.levels:
            if time.perf_counter() >= deadline:
                skipped.append(level)
                continue
            levels.append(await run_level(client, target, args, level, deadline))
    return {
        "url": target.base_url,
        "model": target.model,
        "levels": levels,
        "skipped": skipped,
        "error": None,
    }


async def bench_all(args) -> dict:
    deadline = time.perf_counter() + args.max_run_s
    results = {}
    for target in args.targets:
        if target.spec is not None:
            results[target.name] = await bench_served(target, args, deadline)
            continue
        log(f"{target.name}: {target.base_url}")
        results[target.name] = await bench_target(target, args, deadline)
    for name in args.peers:
        results[name] = await bench_peer(name, args, deadline)
    return results


async def bench_served(target: Target, args, deadline: float) -> dict:
    """--serve: start our server from the config (`python -m serve_app` on a free port), bench
    it like any target with its process tree's CPU, and stop it, so that the next target or
    peer has the machine to itself (an idle server of ours beside it takes a few % of a core).
    A server that does not get ready in time is skipped with the end of its log."""
    log_path = args.out.with_name(f"{args.out.stem}-{target.name}.log")
    log(f"{target.name}: starting our server from {args.serve} (log {log_path}) ...")
    process = None
    try:
        process, url = await asyncio.to_thread(start_server, target.spec, log_path)
        await asyncio.to_thread(wait_ready, url, args.serve_start_timeout, process, log_path)
        target.base_url = f"{url}/v1"
        target.server_pids = [process.pid] if TreeCPU.available() else []
        log(f"{target.name}: {target.base_url}")
        result = await bench_target(target, args, deadline)
    except (RuntimeError, OSError) as exc:
        log(f"{target.name}: skipped: {exc}")
        result = {"url": None, "model": target.model, "levels": [],
                  "skipped": list(args.levels), "error": str(exc)}  # fmt: skip
    finally:
        if process is not None:
            await asyncio.to_thread(stop_server, process)
            await asyncio.sleep(SETTLE_S)
    command = " ".join(server_command(log_path.with_suffix(".yaml")))
    result["server"] = {"config": str(args.serve), "command": command, "log": str(log_path)}
    return result


async def bench_peer(name: str, args, deadline: float) -> dict:
    """Start the peer on the same weights, run the same levels against it, stop it."""
    peer = Peer(
        name,
        args.peer_model_dir,
        args.model or (args.targets[0].model or "demo"),
        args.peer_dtype,
        args.out.with_name(f"{args.out.stem}-{name}.log"),
        start_timeout_s=args.peer_start_timeout,
    )
    try:
        refused = [what for flag, what in REFUSES.get(name, {}).items() if getattr(args, flag)]
        if refused:
            raise PeerUnavailable(
                f"its completions API takes no {' and no '.join(refused)}: run without "
                "--token-ids / --ignore-eos to compare with it"
            )
        model = await asyncio.to_thread(peer.start)
        pids = peer.pids() if TreeCPU.available() else []  # elsewhere: no server CPU figures
        target = Target(name, peer.base_url, model, server_pids=pids)
        log(f"{name}: {target.base_url} (model {model!r}, weights {args.peer_model_dir})")
        result = await bench_target(target, args, deadline)
    except PeerUnavailable as exc:
        log(f"{name}: skipped: {exc}")
        result = {"url": None, "model": None, "levels": [], "skipped": list(args.levels),
                  "error": str(exc)}  # fmt: skip
    finally:
        await asyncio.to_thread(peer.stop)
    result["peer"] = {"weights": str(args.peer_model_dir), "dtype": args.peer_dtype,
                      "command": peer.describe(), "log": str(peer.log)}  # fmt: skip
    return result


def workload_record(args) -> dict:
    """The workload as the JSON result describes it."""
    prompts = (
        f"uniform random token ids below {args.vocab_size}"
        if args.api == "completions" and args.token_ids
        else "random common English words (about one token each)"
    )
    return {
        "api": args.api,
        "prompt_len": str(args.prompt_len),
        "output_len": str(args.output_len),
        "prompts": f"{prompts}, random.Random('SEED:LEVEL'), the same for every target",
        "mode": "poisson_rate" if args.rate else "concurrency",
        "levels": args.levels,
        "max_concurrency": args.max_concurrency if args.rate else None,
        "num_requests": args.num_requests,
        "duration_s": args.duration,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "stream_interval": args.stream_interval,
        "client_sched": args.sched,
        "warmup_requests": args.warmup,
        "request_timeout_s": args.timeout,
        "max_run_s": args.max_run_s,
        "itl": "gaps between chunks that carry text; a chunk with several tokens is one gap",
        "output_tokens": "usage.completion_tokens when the server sends it, else text chunks",
    }


def run_loop(coro):
    """`coro` on uvloop where it is installed (it comes with ray[serve]): its event loop costs
    the load generator ~15 % less CPU per streamed chunk than asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def bench(args) -> dict:
    """Run the sweep against every target; print the table, write the JSON (and plots)."""
    run = Run.begin(machine_info(("httptools", "uvloop"), client="bench/serve.py"))
    results = run_loop(bench_all(args))
    print_table(results, args)
    body = {
        "workload": workload_record(args),
        "targets": {t.name: {"url": t.base_url, "model": t.model} for t in args.targets},
        "peers": args.peers,
        "results": results,
    }
    run.write(args.out, **body)
    if args.plot is not None:
        for path in plot(results, args.plot, args):
            print(f"wrote {path}")
    return body


# -- arguments ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--target",
        action="append",
        metavar="NAME=URL",
        help=f"an OpenAI-compatible base URL, repeatable (default {DEFAULT_TARGET})",
    )
    p.add_argument(
        "--serve",
        type=Path,
        metavar="CONFIG",
        help="start our server from this Serve config (python -m serve_app on a free port), "
        f"bench it as the target {SERVED_NAME!r} with its processes' CPU, and stop it before "
        "the next target or peer; its first model gives --model and, with --peers, the "
        "peers' weights and dtype",
    )
    p.add_argument(
        "--serve-start-timeout",
        type=float,
        default=START_TIMEOUT_S,
        help="seconds the --serve server may take to be ready",
    )
    p.add_argument("--model", help="served model name (default: the first of GET {base}/models)")
    p.add_argument(
        "--server-pid",
        type=int,
        action="append",
        metavar="PID",
        help="a process of the server on this machine (Linux), repeatable: its CPU and its "
        "descendants' is reported per output token, per level (use with one --target)",
    )
    p.add_argument("--workload", type=Path, help="JSON file with workload keys (flags win)")
    add_workload_args(p)
    p.add_argument("--out", type=Path, default=default_out("serve"))
    p.add_argument(
        "--plot",
        type=Path,
        metavar="PREFIX",
        help="PNG prefix (default: --out without .json); needs matplotlib",
    )
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--replot",
        type=Path,
        metavar="RESULT.json",
        help="send nothing: draw the plots of a result this bench wrote (to --plot, default the "
        "result's path without .json), e.g. after installing matplotlib",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument(
        "--sched",
        choices=["batch", "normal"],
        default="batch",
        help="the load generator's scheduling policy while a level runs (Linux): batch (the "
        "default) reads what a server wrote without preempting it on every chunk, as a client "
        "on another machine would not; normal, as any process",
    )
    p.add_argument(
        "--peers",
        nargs="?",
        const="",
        metavar="vllm,transformers",
        help="also start these peer servers (default: both) on --peer-model-dir, one after "
        "the other after the targets, and bench them the same way",
    )
    p.add_argument(
        "--peer-model-dir",
        type=Path,
        help="weights folder for the peers (default: the --serve config's first model, else "
        "the built-in demo model, the weights bench/demo.yaml serves)",
    )
    p.add_argument(
        "--peer-dtype",
        help="peers' dtype (default: the --serve model's, as our engine resolves it here; "
        "else bfloat16)",
    )
    p.add_argument(
        "--peer-start-timeout",
        type=float,
        default=900.0,
        help="seconds a peer may take to install (first use) and answer",
    )
    return p


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The flags a --workload file may set too (WORKLOAD_KEYS)."""
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--prompt-len", default="128", help="N, uniform:LO:HI or normal:MEAN:STD")
    p.add_argument("--output-len", default="128", help="max_tokens: N, uniform:LO:HI, normal:M:S")
    p.add_argument(
        "--token-ids",
        action="store_true",
        help="completions: send the prompt as random token ids (exact lengths)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=VOCAB_REGULAR,
        help="token ids are drawn below this (default: the demo tokenizer's)",
    )
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, help="levels of the sweep")
    p.add_argument(
        "--rate",
        default=None,
        help="Poisson request rates (req/s) as the levels instead of concurrencies",
    )
    p.add_argument("--max-concurrency", type=int, default=256, help="in flight cap with --rate")
    p.add_argument("--duration", type=float, help="seconds per level (stop sending after)")
    p.add_argument(
        "--num-requests",
        type=int,
        help="requests per level (default: 4 x level, >= 16, unless --duration)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--stream-interval",
        type=int,
        help="send stream_interval: N (tokens per streamed chunk, first and last at once; "
        "vLLM's extension): the server's work per token against burstier streams",
    )
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per target")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request limit, seconds")
    p.add_argument(
        "--max-run-s",
        type=float,
        default=3600.0,
        help="overall limit: no level starts, and no request is sent, after it",
    )


def load_workload(path: Path, parser: argparse.ArgumentParser) -> dict:
    """The workload file's keys as parser defaults, so that flags given explicitly win."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"--workload {path}: {exc}")
    if not isinstance(raw, dict):
        parser.error(f"--workload {path}: want a JSON object")
    values = {key.replace("-", "_"): value for key, value in raw.items()}
    unknown = sorted(set(values) - WORKLOAD_KEYS)
    if unknown:
        parser.error(f"--workload {path}: unknown keys {unknown}; known {sorted(WORKLOAD_KEYS)}")
    for key in ("concurrency", "rate"):  # lists in JSON, comma lists on the command line
        if isinstance(values.get(key), list):
            values[key] = ",".join(str(v) for v in values[key])
    return values


def parse_levels(text, kind, parser) -> list:
    try:
        levels = [kind(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(x <= 0 for x in levels):
        parser.error(f"bad levels {text!r}: want a comma list of positive numbers")
    return levels


def parse_target(text: str) -> Target:
    name, sep, url = text.partition("=")
    if not sep:  # a bare URL names itself
        name, url = text, text
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"bad --target {text!r}: want NAME=http(s)://host:port/v1")
    return Target(name, url.rstrip("/"))


def served_target(path: Path, parser: argparse.ArgumentParser) -> tuple[Target, str, str]:
    """The --serve target (its URL once started), its first model's weights and dtype."""
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--serve {path}: {exc}")
    if not isinstance(spec, dict):
        parser.error(f"--serve {path}: not a Serve config (want a YAML mapping)")
    try:
        model, weights, dtype = first_model(spec)
    except SystemExit as exc:
        parser.error(f"--serve {path}: {exc}")
    except (KeyError, TypeError) as exc:
        parser.error(f"--serve {path}: its first ModelConfig lacks {exc}")
    return Target(SERVED_NAME, "", model, spec=spec), weights, dtype


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    if first.workload is not None:
        parser.set_defaults(**load_workload(first.workload, parser))
    args = parser.parse_args(argv)
    try:
        args.peers = parse_peers(args.peers) if args.peers is not None else []
        args.prompt_len = parse_length(args.prompt_len)
        args.output_len = parse_length(args.output_len)
        args.targets = [
            parse_target(t) for t in args.target or ([] if args.serve else [DEFAULT_TARGET])
        ]
        for target in args.targets:
            target.server_pids = list(args.server_pid or [])
    except ValueError as exc:
        parser.error(str(exc))
    served_weights, served_dtype = None, None
    if args.serve is not None:
        served, served_weights, served_dtype = served_target(args.serve, parser)
        args.targets.insert(0, served)
    for pid in args.server_pid or []:
        if not TreeCPU.exists(pid):
            parser.error(f"--server-pid {pid}: no such process here (server CPU needs Linux /proc)")
    names = [t.name for t in args.targets] + args.peers
    if len(set(names)) != len(names):
        parser.error(
            f"--target names must differ (from each other, from --peers and, with --serve, "
            f"from {SERVED_NAME!r})"
        )
    if args.peers and args.peer_model_dir is None:
        from serve_app.models.loader import resolve_model_path

        try:
            args.peer_model_dir = resolve_model_path(served_weights or "demo")
        except (OSError, ValueError) as exc:
            parser.error(f"the peers' weights: {exc}")
    if args.peer_dtype is None:
        args.peer_dtype = resolved_dtype(served_dtype) if served_dtype else "bfloat16"
    args.rate = parse_levels(args.rate, float, parser) if args.rate is not None else None
    args.levels = args.rate or parse_levels(args.concurrency, int, parser)
    if args.duration is not None and args.duration <= 0:
        parser.error("--duration must be > 0")
    if args.num_requests is not None and args.num_requests < 1:
        parser.error("--num-requests must be >= 1")
    if args.stream_interval is not None and args.stream_interval < 1:
        parser.error("--stream-interval must be >= 1")
    if args.timeout <= 0 or args.max_run_s <= 0:
        parser.error("--timeout and --max-run-s must be > 0")
    if args.replot is not None and args.no_plot:
        parser.error("--replot draws plots: drop --no-plot")
    if args.plot is None and not args.no_plot:
        args.plot = (args.replot or args.out).with_suffix("")
    elif args.no_plot:
        args.plot = None
    return args


def replot(path: Path, prefix: Path) -> list[Path]:
    """The plots of a result this bench wrote, drawn again from its JSON."""
    report = json.loads(path.read_text())
    workload = report["workload"]
    levels = workload["levels"]
    args = argparse.Namespace(
        levels=levels, rate=levels if workload["mode"] == "poisson_rate" else None
    )
    return plot(report["results"], prefix, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        for path in replot(args.replot, args.plot):
            print(f"wrote {path}")
        return 0
    bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
