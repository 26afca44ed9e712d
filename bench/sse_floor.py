"""What streaming costs on this machine before any model or Ray: the floor under the serving path.

    .venv/bin/python -m bench.sse_floor --concurrency 32 --duration 30
    # and a running server in the same table (its process and descendants measured):
    .venv/bin/python -m bench.sse_floor --live http://127.0.0.1:8000/v1 --live-pid PID

Two stand-in servers, each in a process of its own under uvicorn (uvloop, httptools: what Ray
Serve's HTTP runs on), stream the same completions chunks, one token each, at a fixed engine
pace (`--step-ms` per step, every stream a chunk per step, as a decode batch does):

* `bare`: a minimal ASGI app that writes the SSE events itself: uvicorn, the event loop and the
  kernel's TCP, nothing more.
* `app`: serve_app's FastAPI app (every route, middleware, the pipeline, the SSE rendering) over
  a stand-in backend that yields the chunks: what the ingress costs without Ray around it.

`bench/serve.py` drives each (and `--live`) with the same workload and reports, per output token,
the server's CPU and its own (the load generator shares the machine). The difference between
`app` and `bare` is the app's own cost per chunk, between a live server's ingress and `app` what
Ray Serve and the token path add, and `bare` plus the load generator is what any Python HTTP
streaming costs here whatever the server does. Linux (/proc) only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

from bench.common import Run, default_out, machine_info  # noqa: E402
from bench.peers import free_port  # noqa: E402

MODEL = "demo"
MODES = ("bare", "app")
START_TIMEOUT_S = 60.0


# -- the stand-in servers (run with --serve MODE) -----------------------------------------------


class StepClock:
    """Every `step_s` wakes everything that waits for the next step, like an engine step."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self._waiters: list[asyncio.Future] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def next_step(self) -> asyncio.Future:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return waiter

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():  # a stream whose client left cancelled its own
                    waiter.set_result(None)


def chunk_payload(index: int, count: int) -> dict:
    """A completions stream chunk as ours sends it; the last carries the usage."""
    last = index == count - 1
    payload = {"id": "cmpl-floor", "object": "text_completion", "created": 0, "model": MODEL,
               "choices": [{"index": 0, "text": " x", "logprobs": None,
                            "finish_reason": "length" if last else None}]}  # fmt: skip
    if last:
        payload["usage"] = {"prompt_tokens": 1, "completion_tokens": count, "total_tokens": count}
    return payload


def bare_app(clock: StepClock):
    """The minimal ASGI app: GET .../models, and POST .../completions streamed as SSE."""

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                clock.start()
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] == "GET":
            models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "http.response.body", "body": json.dumps(models).encode()})
            return
        count = json.loads(body)["max_tokens"]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        for i in range(count):
            await clock.next_step()
            event = f"data: {json.dumps(chunk_payload(i, count))}\n\n".encode()
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


class StandInBackend:
    """serve_app's Backend without a model: every prompt is one token, every chunk one token a
    step of the clock, `max_tokens` of them."""

    replica_deployments: list[str] = []

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    async def tokenize(self, req):
        from serve_app.messages import TokenizedPrompt

        return TokenizedPrompt([1], 1)

    async def unavailable(self, model):
        return None

    async def generate(self, model, req):
        from serve_app.messages import ChoiceDelta, ReplicaChunk, StepInfo

        count = req.params.max_tokens
        for i in range(count):
            await self.clock.next_step()
            last = i == count - 1
            choice = ChoiceDelta(index=0, token_ids=[5], text=" x", num_output_tokens=i + 1,
                                 finish_reason="length" if last else None)  # fmt: skip
            step = StepInfo(batch_size=1, queue_wait_us=0.0, decode_time_ms=self.clock.step_s * 1e3)
            yield ReplicaChunk(req.request_id, [choice], [step], finished=last, num_prompt_tokens=1)

    def watch_stop(self, key, event):
        return None

    async def stop_elsewhere(self, key):
        return False

    async def ready(self):
        return True


def serve(mode: str, port: int, step_s: float) -> None:
    import uvicorn

    clock = StepClock(step_s)
    if mode == "bare":
        app = bare_app(clock)
    else:
        from serve_app.config import load_config
        from serve_app.ingress.app import create_app

        config = load_config(
            {
                "BackendConfig": {
                    "ModelDeployConfig": {
                        "ModelConfig": [{"modelName": MODEL, "modelWeightPath": "demo"}]
                    }
                }
            }
        )
        app = create_app(config, StandInBackend(clock))
        app.router.on_startup.append(clock.start)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                loop="uvloop", http="httptools")  # fmt: skip


# -- the runner ---------------------------------------------------------------------------------


def start(mode: str, step_ms: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "bench.sse_floor",
        "--serve",
        mode,
        "--port",
        str(port),
        "--step-ms",
        str(step_ms),
    ]
    process = subprocess.Popen(cmd, cwd=HERE.parent)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the {mode} server exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return process, url
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the {mode} server did not listen within {START_TIMEOUT_S:g} s")


def measure(name: str, url: str, pid: int, args, out: Path) -> dict:
    """bench/serve.py against one server: its one level's figures."""
    from bench import serve as load

    argv = [f"--target={name}={url}", f"--model={MODEL}", f"--server-pid={pid}", "--token-ids",
            "--ignore-eos", "--prompt-len=1", f"--output-len={args.output_len}",
            f"--concurrency={args.concurrency}", f"--duration={args.duration}", "--no-plot",
            "--no-progress", f"--out={out}"]  # fmt: skip
    body = load.bench(load.parse_args(argv))
    return body["results"][name]["levels"][0]


def run(args) -> dict:
    """Each stand-in, then the live server; the table, and a JSON of every one's figures."""
    record = Run.begin(
        machine_info(("httptools", "uvloop", "uvicorn", "fastapi"), client="bench/serve.py")
    )
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:  # bench/serve.py's own reports, not kept
        for mode in args.modes:
            process, url = start(mode, args.step_ms)
            try:
                rows[mode] = measure(mode, url, process.pid, args, Path(tmp, f"{mode}.json"))
            finally:
                process.terminate()
                process.wait(timeout=30)
        if args.live is not None:
            rows["live"] = measure("live", args.live, args.live_pid, args, Path(tmp, "live.json"))
    print(f"\n{'server':<8} {'tok/s':>8} {'server us/token':>16} {'client us/token':>16}")
    for name, fig in rows.items():
        server, client = fig["server_cpu_us_per_token"], fig["client_cpu_us_per_token"]
        print(f"{name:<8} {fig['output_tokens_per_s']:>8.1f} {server:>16.1f} {client:>16.1f}")
    workload = {
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "output_len": args.output_len,
        "step_ms": args.step_ms,
        "live": args.live,
    }
    record.write(args.out, workload=workload, results=rows)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", type=int, default=32, help="streams at once (default 32)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per server")
    p.add_argument("--output-len", type=int, default=128, help="chunks per request")
    p.add_argument("--step-ms", type=float, default=15.0, help="the stand-in engine's step")
    p.add_argument("--modes", default=",".join(MODES), help="stand-ins to run: bare,app")
    p.add_argument("--live", help="also a running server's base URL (needs --live-pid)")
    p.add_argument("--live-pid", type=int, help="that server's process (with its descendants)")
    p.add_argument("--out", type=Path, default=default_out("sse_floor"))
    p.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)  # the server processes
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if not set(args.modes) <= set(MODES):
        p.error(f"--modes: want a comma list of {', '.join(MODES)}")
    if (args.live is None) != (args.live_pid is None):
        p.error("--live and --live-pid go together")
    if min(args.concurrency, args.output_len) < 1 or min(args.duration, args.step_ms) <= 0:
        p.error("--concurrency, --output-len, --duration and --step-ms must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.port, args.step_ms / 1e3)
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
