"""bench/serve.py against the app served in process by uvicorn on a real socket (no Ray), plus
its pure parts: the length distributions and the SSE parsing of hand-written streams."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import serve_report as sr
from tests.ingress.conftest import local_app
from tests.ingress.conftest import served as served_app
from tests.stepping import Stepping

CONFIG = {
    "BackendConfig": {
        "ModelDeployConfig": {
            "maxSeqLen": 256,
            "maxInputTokenLen": 128,
            "ModelConfig": [{"modelName": "demo", "modelWeightPath": "demo-tiny"}],
        },
        "ScheduleConfig": {
            "maxIterTimes": 16,
            "maxPrefillTokens": 256,
            "cacheBlockSize": 16,
            "kvCacheBlocks": 64,
        },
    }
}


@pytest.fixture(scope="module")
def sb(load_bench):
    return load_bench("serve")


@pytest.fixture(scope="module")
def served():
    """(base URL, model replica): the app on 127.0.0.1:<free port>, served by uvicorn in a
    background thread."""
    app, replica = local_app(CONFIG)
    try:
        with served_app(app) as url:
            yield f"{url}/v1", replica
    finally:
        replica.shutdown()


@pytest.fixture(scope="module")
def base_url(served):
    return served[0]


# -- pure parts ---------------------------------------------------------------------------------


def test_parse_length(sb):
    rng = random.Random(0)
    assert str(sb.parse_length("128")) == "128"
    assert sb.parse_length(7).sample(rng) == 7
    uniform = sb.parse_length("uniform:3:5")
    assert str(uniform) == "uniform:3:5"
    assert {uniform.sample(rng) for _ in range(200)} == {3, 4, 5}
    normal = sb.parse_length("normal:10:100")
    assert all(normal.sample(rng) >= 1 for _ in range(200))
    for bad in ("0", "-3", "uniform:5:3", "uniform:0:4", "zipf:1:2", "uniform:1", "x"):
        with pytest.raises(ValueError):
            sb.parse_length(bad)


def feed(sb, lines: list[str]):
    """A Record fed `lines` one per second after its start at 0; stops where note_line does."""
    rec = sb.Record(start=0.0)
    for t, line in enumerate(lines, start=1):
        if sb.note_line(rec, line, float(t)):
            break
    return rec


def test_sse_completions_stream(sb):
    rec = feed(
        sb,
        [
            'data: {"choices":[{"index":0,"text":"Hel","finish_reason":null}]}',
            "",
            ": a comment",
            'data: {"choices":[{"index":0,"text":"lo there","finish_reason":null}]}',
            'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}],'
            '"usage":{"prompt_tokens":5,"completion_tokens":4,"total_tokens":9}}',
            "data: [DONE]",
            'data: {"choices":[{"index":0,"text":"after done"}]}',
        ],
    )
    assert rec.done and rec.error is None
    assert rec.token_times == [1.0, 4.0]  # the chunks with text; the empty last one is not
    assert rec.ttft == 1.0 and rec.itls == [3.0]
    assert rec.tokens == 4 and rec.prompt_tokens == 5  # usage wins over the chunk count


def test_sse_chat_stream(sb):
    head = '"object":"chat.completion.chunk","model":"demo"'
    rec = feed(
        sb,
        [
            f'data: {{{head},"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
            '"finish_reason":null}],"usage":null}',
            f'data: {{{head},"choices":[{{"index":0,"delta":{{"content":"Hi"}}}}],"usage":null}}',
            f'data: {{{head},"choices":[{{"index":0,"delta":{{"content":"!"}}}}],"usage":null}}',
            f'data: {{{head},"choices":[{{"index":0,"delta":{{}},"finish_reason":"stop"}}]}}',
            f'data: {{{head},"choices":[],"usage":{{"prompt_tokens":9,"completion_tokens":2}}}}',
            "data: [DONE]",
        ],
    )
    assert rec.done and rec.error is None
    assert rec.token_times == [2.0, 3.0] and rec.ttft == 2.0 and rec.itls == [1.0]
    assert rec.tokens == 2 and rec.prompt_tokens == 9
    no_usage = feed(sb, ['data: {"choices":[{"delta":{"content":"a"}}]}', "data: [DONE]"])
    assert no_usage.output_tokens is None and no_usage.tokens == 1  # counted from the chunks
    failed = feed(sb, ['data: {"error":{"message":"boom","code":500}}', "data: [DONE]"])
    assert failed.error and "boom" in failed.error and not failed.done


def test_peers_flag(sb):
    assert sb.parse_args([]).peers == []
    assert sb.parse_args(["--peers"]).peers == ["vllm", "transformers"]
    assert sb.parse_args(["--peers", "vllm"]).peers == ["vllm"]
    with pytest.raises(SystemExit):
        sb.parse_args(["--peers", "tgi"])
    with pytest.raises(SystemExit):  # a target may not take a peer's name
        sb.parse_args(["--peers", "vllm", "--target", "vllm=http://127.0.0.1:1/v1"])


# The stand-in servers below (a peer, and --serve's server) are processes of their own that
# forward every request to the module's app (`served`, in this process) and stream its answers
# back: the bench starts, waits for, benches, measures and stops a separate server process, as
# it would vLLM or `python -m serve_app`, and that process loads no model of its own. Forwarding
# alone costs less CPU than /proc counts (10 ms ticks), so each generation request also spends
# SERVER_CPU_S of the stand-in's CPU, as a server's own work would: its CPU is always measured.
SERVER_CPU_S = 0.03
FORWARD = f"""
import time
import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


def forwarding_app(upstream):
    client = httpx.AsyncClient(base_url=upstream, timeout=60)

    async def forward(request):
        if request.method == "POST":
            end = time.process_time() + {SERVER_CPU_S}
            while time.process_time() < end:
                pass
        kind = request.headers.get("content-type", "application/json")
        sent = client.build_request(request.method, request.url.path, params=request.query_params,
                                    content=await request.body(), headers={{"content-type": kind}})
        got = await client.send(sent, stream=True)
        kind = got.headers.get("content-type", "")
        if kind.startswith("text/event-stream"):  # streamed on as it comes
            return StreamingResponse(got.aiter_raw(), got.status_code, media_type=kind,
                                     background=BackgroundTask(got.aclose))
        body = await got.aread()
        await got.aclose()
        return Response(body, got.status_code, media_type=kind)

    return Starlette(routes=[Route("/{{path:path}}", forward, methods=["GET", "POST"])])
"""

# A stand-in peer: `python -c FAKE_PEER <the app's root URL> <port>`, started and stopped by
# bench/peers.py exactly as vLLM or `transformers serve` would be.
FAKE_PEER = (
    FORWARD
    + """
import sys, uvicorn
uvicorn.run(forwarding_app(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]),
            log_level="warning")
"""
)


def app_root(base_url: str) -> str:
    return base_url.removesuffix("/v1")


def test_peers_are_started_benched_stopped_and_skipped_when_they_cannot_serve_the_workload(
    sb, base_url, tmp_path, monkeypatch
):
    peers = sys.modules["bench.peers"]
    started = []

    def command(self):
        assert self.name == "vllm", "transformers refuses ignore_eos: never started"
        return [sys.executable, "-c", FAKE_PEER, app_root(base_url), str(self.port)], None

    def start(self):
        model = original_start(self)
        started.append(self.process)
        return model

    original_start = peers.Peer.start
    monkeypatch.setattr(peers.Peer, "command", command)
    monkeypatch.setattr(peers.Peer, "start", start)
    out = tmp_path / "peers.json"
    argv = [
        f"--target=ours={base_url}", "--peers", "--peer-model-dir", str(tmp_path),
        "--concurrency=2", "--num-requests=2", "--prompt-len=4", "--output-len=4",
        "--ignore-eos", "--warmup=0", "--timeout=60", "--no-progress", "--no-plot",
        f"--out={out}",
    ]  # fmt: skip
    args = sb.parse_args(argv)
    sb.bench(args)
    report = json.loads(out.read_text())
    assert report["peers"] == ["vllm", "transformers"]
    vllm = report["results"]["vllm"]
    assert vllm["levels"][0]["completed"] == 2 and vllm["levels"][0]["errors"] == 0
    assert vllm["model"] == "demo" and vllm["peer"]["weights"] == str(tmp_path)
    assert vllm["levels"][0]["server_cpu_us_per_token"] > 0  # the peer's process, measured
    skipped = report["results"]["transformers"]
    assert skipped["levels"] == [] and skipped["skipped"] == [2]
    assert "takes no ignore_eos" in skipped["error"]
    assert started and all(process.poll() is not None for process in started)  # stopped
    (line,) = sr.ratio_lines(report["results"], args)
    assert line.startswith("ours / vllm output tok/s  2: ")


# --serve's stand-in for `python -m serve_app CONFIG`: on the port that bench/server_process.py
# wrote into the config's copy, answering /v2/health/ready and the rest as the module's app does;
# it reads the copy's application args as the server would, and exits if they are not the
# config's (one model, "demo").
FAKE_SERVE = (
    FORWARD
    + """
import sys, uvicorn, yaml
from serve_app.config import load_config
spec = yaml.safe_load(open(sys.argv[1]))
config = load_config(spec["applications"][0]["args"])
models = [model.modelName for model in config.BackendConfig.ModelDeployConfig.ModelConfig]
if models != ["demo"]:
    sys.exit(f"not the config's models: {models}")
uvicorn.run(forwarding_app(sys.argv[2]), host="127.0.0.1", port=spec["http_options"]["port"],
            log_level="warning")
"""
)


def serve_config(tmp_path, dtype="float32"):
    """A Serve config file whose first model is demo-tiny, as `--serve` reads it."""
    import yaml

    args = json.loads(json.dumps(CONFIG))
    args["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["dtype"] = dtype
    spec = {
        "http_options": {"host": "127.0.0.1", "port": 1},
        "applications": [{"name": "serve_app", "import_path": "serve_app.app:build_app",
                          "args": args}],
    }  # fmt: skip
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_serve_starts_our_server_benches_it_and_stops_it_before_the_peer_starts(
    sb, base_url, tmp_path, monkeypatch
):
    sp, peers = sys.modules["bench.server_process"], sys.modules["bench.peers"]
    root = app_root(base_url)
    monkeypatch.setattr(sp, "server_command", lambda config: [sys.executable, "-c", FAKE_SERVE,
                                                              str(config), root])  # fmt: skip
    monkeypatch.setattr(sb, "SETTLE_S", 0.0)
    ours = []

    def start_server(spec, log_path):
        process, url = sp.start_server(spec, log_path)
        ours.append(process)
        return process, url

    monkeypatch.setattr(sb, "start_server", start_server)
    at_peer_start = []

    def command(self):
        at_peer_start.append(ours[0].poll())  # our server: already gone
        return [sys.executable, "-c", FAKE_PEER, root, str(self.port)], None

    monkeypatch.setattr(peers.Peer, "command", command)
    out = tmp_path / "served.json"
    argv = [
        f"--serve={serve_config(tmp_path)}", "--peers=vllm", f"--peer-model-dir={tmp_path}",
        "--concurrency=2", "--num-requests=2", "--prompt-len=4", "--output-len=4",
        "--ignore-eos", "--warmup=0", "--timeout=60", "--no-progress", "--no-plot",
        f"--out={out}",
    ]  # fmt: skip
    args = sb.parse_args(argv)
    assert [t.name for t in args.targets] == ["ours"] and args.targets[0].model == "demo"
    assert args.peer_dtype == "float32"  # the served model's dtype, not bfloat16
    sb.bench(args)
    report = json.loads(out.read_text())
    served = report["results"]["ours"]
    assert served["levels"][0]["completed"] == 2 and served["levels"][0]["errors"] == 0
    assert served["levels"][0]["server_cpu_us_per_token"] > 0  # its process tree, measured
    assert report["targets"]["ours"]["url"].startswith("http://127.0.0.1:")
    assert served["server"]["config"] == str(tmp_path / "serve.yaml")
    assert served["server"]["log"] == str(tmp_path / "served-ours.log")
    assert ours[0].poll() is not None and at_peer_start and at_peer_start[0] is not None
    assert report["results"]["vllm"]["levels"][0]["completed"] == 2
    (line,) = sr.ratio_lines(report["results"], args)
    assert line.startswith("ours / vllm output tok/s  2: ")


def test_a_served_server_that_does_not_start_is_skipped_with_its_log(sb, tmp_path, monkeypatch):
    sp = sys.modules["bench.server_process"]
    failing = [sys.executable, "-c", "print('no model here'); raise SystemExit(2)"]
    monkeypatch.setattr(sp, "server_command", lambda config: failing)
    monkeypatch.setattr(sb, "SETTLE_S", 0.0)
    out = tmp_path / "failed.json"
    argv = [f"--serve={serve_config(tmp_path)}", "--concurrency=2", "--num-requests=2",
            "--warmup=0", "--no-progress", "--no-plot", f"--out={out}"]  # fmt: skip
    sb.bench(sb.parse_args(argv))
    served = json.loads(out.read_text())["results"]["ours"]
    assert served["levels"] == [] and served["skipped"] == [2]
    assert "exited with 2" in served["error"] and "no model here" in served["error"]


def test_serve_arguments(sb, tmp_path):
    path = serve_config(tmp_path, dtype="bfloat16")
    args = sb.parse_args([f"--serve={path}", "--target=other=http://127.0.0.1:1/v1"])
    assert [t.name for t in args.targets] == ["ours", "other"]  # ours first, then the rest
    assert args.peer_dtype == "bfloat16"
    assert sb.parse_args([]).peer_dtype == "bfloat16"  # no --serve: as before
    assert sb.parse_args([f"--serve={path}", "--peer-dtype=float32"]).peer_dtype == "float32"
    with pytest.raises(SystemExit):  # its name is taken
        sb.parse_args([f"--serve={path}", "--target=ours=http://127.0.0.1:1/v1"])
    with pytest.raises(SystemExit):
        sb.parse_args([f"--serve={tmp_path / 'missing.yaml'}"])
    (tmp_path / "empty.yaml").write_text("applications: []\n")
    with pytest.raises(SystemExit):  # no model to serve
        sb.parse_args([f"--serve={tmp_path / 'empty.yaml'}"])


def test_a_peer_that_cannot_start_is_unavailable_with_its_log(sb, tmp_path, monkeypatch):
    peers = sys.modules["bench.peers"]
    failing = [sys.executable, "-c", "print('no such backend'); raise SystemExit(3)"]
    monkeypatch.setattr(peers.Peer, "command", lambda self: (failing, None))
    peer = peers.Peer("transformers", tmp_path, "demo", "bfloat16", tmp_path / "peer.log")
    with pytest.raises(peers.PeerUnavailable, match="exited with 3.*no such backend"):
        peer.start()
    assert peer.process.poll() == 3


def test_workload_file_and_flags(sb, tmp_path):
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"prompt-len": "uniform:4:8", "concurrency": [2, 3], "seed": 5}))
    args = sb.parse_args(["--workload", str(workload), "--seed", "7", "--no-plot"])
    assert str(args.prompt_len) == "uniform:4:8" and args.levels == [2, 3]
    assert args.seed == 7  # a flag given explicitly wins over the file
    assert args.plot is None and args.targets[0].name == "ours"


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_stream_interval_is_asked_for_only_when_given(sb, tmp_path, api):
    args = sb.parse_args([f"--api={api}", "--no-plot"])
    assert "stream_interval" not in sb.request_body(args, "m", "a b", 8)[1]
    args = sb.parse_args([f"--api={api}", "--stream-interval=4", "--no-plot"])
    assert sb.request_body(args, "m", "a b", 8)[1]["stream_interval"] == 4
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"stream_interval": 2}))
    assert sb.parse_args(["--workload", str(workload), "--no-plot"]).stream_interval == 2
    with pytest.raises(SystemExit):
        sb.parse_args(["--stream-interval=0", "--no-plot"])


# -- against the server ---------------------------------------------------------------------------

LEVEL_KEYS = {
    "level", "requests", "completed", "errors", "timeouts", "error_samples", "wall_s",
    "output_tokens", "output_tokens_per_s", "requests_per_s", "mean_output_tokens",
    "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms",
    "e2e_p50_ms", "e2e_p99_ms",
}  # fmt: skip


def test_send_records_http_errors_refused_connections_and_timeouts(sb, served, monkeypatch):
    """Every way a request fails ends in its Record, never in an exception out of send."""
    base_url, replica = served
    # each engine step at least 50 ms: the 16-token stream outlasts its 0.3 s on any machine
    Stepping(replica.engine.engine, monkeypatch, pace_s=0.05)

    async def run() -> list:
        async with sb.session() as client:
            url = base_url + "/completions"
            ok = {"model": "demo", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
            bad = {**ok, "max_tokens": -1}
            with socket.socket() as s:  # a port nobody listens on
                s.bind(("127.0.0.1", 0))
                closed = f"http://127.0.0.1:{s.getsockname()[1]}/v1/completions"
            slow = {**ok, "max_tokens": 16, "ignore_eos": True}
            return [
                await sb.send(client, url, ok, 30),
                await sb.send(client, url, bad, 30),
                await sb.send(client, closed, ok, 30),
                await sb.send(client, url, slow, 0.3),
            ]

    ok, bad, refused, late = asyncio.run(run())
    assert ok.error is None and ok.done and ok.tokens == 4 and ok.ttft > 0
    assert bad.error.startswith("HTTP 400") and "max_tokens" in bad.error and not bad.done
    assert refused.error.startswith("ConnectionRefusedError") and not refused.timed_out
    assert late.timed_out and late.error == "timeout after 0.3 s"
    assert late.tokens < 16 and not late.done  # cut before its end
    assert all(r.end >= r.start for r in (ok, bad, refused, late))


def test_a_target_that_never_answers_its_model_list_is_skipped_at_the_timeout(sb):
    """A server that accepts the connection and then says nothing costs --timeout, not the run."""

    async def run():
        silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = silent.sockets[0].getsockname()[1]
        target = sb.Target("mute", f"http://127.0.0.1:{port}/v1")
        args = sb.parse_args([f"--target=mute=http://127.0.0.1:{port}/v1", "--timeout=0.5"])
        try:
            async with sb.session() as client:
                t0 = time.perf_counter()
                error = await sb.resolve_model(client, target, args)
                return error, time.perf_counter() - t0
        finally:
            silent.close()

    error, waited = asyncio.run(run())
    assert error.startswith("TimeoutError") and waited < 5


def test_a_chunk_json_reads_strictly_refuses_is_still_read(sb):
    """Python's json writes non-finite floats as NaN / Infinity; the strict fast parser refuses
    them, and the chunk is read by json instead of failing the request."""
    rec = feed(
        sb,
        [
            'data: {"choices":[{"index":0,"text":"a","logprobs":{"token_logprobs":[-Infinity]}}]}',
            'data: {"choices":[{"index":0,"text":"b","logprobs":{"token_logprobs":[NaN]}}]}',
            "data: [DONE]",
        ],
    )
    assert rec.done and rec.error is None and rec.token_times == [1.0, 2.0]


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_the_load_generator_runs_a_level_at_sched_batch_and_returns_to_its_policy(sb):
    before = os.sched_getscheduler(0)
    with sb.batch_scheduled(True):
        assert os.sched_getscheduler(0) == os.SCHED_BATCH
    assert os.sched_getscheduler(0) == before
    with sb.batch_scheduled(False):
        assert os.sched_getscheduler(0) == before
    assert sb.parse_args([]).sched == "batch"
    assert sb.parse_args(["--sched=normal"]).sched == "normal"


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_sweep_against_the_app(sb, base_url, tmp_path, api):
    out = tmp_path / f"serve-{api}.json"
    argv = [
        f"--target=ours={base_url}",
        f"--target=again={base_url}/",  # a second target: one entry per target everywhere
        f"--api={api}",
        "--concurrency=1,2",
        "--num-requests=3",
        "--prompt-len=uniform:4:8",
        "--output-len=6",
        "--ignore-eos",
        "--warmup=1",
        "--timeout=60",
        "--max-run-s=120",
        "--no-progress",
        f"--out={out}",
        f"--plot={tmp_path / api}",
        f"--server-pid={os.getpid()}",  # the app serves from this process
    ]
    if api == "completions":
        argv.append("--token-ids")
    body = sb.bench(sb.parse_args(argv))

    report = json.loads(out.read_text())
    assert {"date", "machine", "loadavg_start", "workload", "targets", "results"} <= set(report)
    assert report["workload"]["api"] == api and report["workload"]["levels"] == [1, 2]
    assert report["workload"]["client_sched"] == "batch"
    assert set(report["results"]) == {"ours", "again"}
    for name, res in report["results"].items():
        assert res["model"] == "demo" and res["url"] == base_url  # asked from GET /v1/models
        assert [lvl["level"] for lvl in res["levels"]] == [1, 2] and res["skipped"] == []
        for lvl in res["levels"]:
            assert LEVEL_KEYS <= set(lvl), (name, set(LEVEL_KEYS) - set(lvl))
            assert lvl["errors"] == 0, lvl["error_samples"]
            assert lvl["requests"] == lvl["completed"] == 3
            assert lvl["output_tokens"] == 3 * 6 and lvl["mean_output_tokens"] == 6
            assert lvl["usage_reported"] == 3  # both APIs send usage on our server
            for key in ("ttft", "itl"):
                assert all(lvl[f"{key}_p{q}_ms"] > 0 for q in (50, 90, 99))
            assert lvl["e2e_p99_ms"] >= lvl["e2e_p50_ms"] > 0
            assert lvl["output_tokens_per_s"] > 0 and lvl["requests_per_s"] > 0
            # CPU per output token: the load generator's own, and the server's processes'
            assert lvl["client_cpu_s"] > 0 and lvl["client_cpu_us_per_token"] > 0
            assert lvl["server_cpu_us_per_token"] > 0
            assert lvl["server_cpu_s"] == pytest.approx(
                sum(lvl["server_cpu_by_process_s"].values())
            )
    lines = sr.cpu_lines(body["results"])
    assert len(lines) == 4 and all(line.startswith("CPU per output token, ") for line in lines)
    assert "client" in lines[0] and "server" in lines[0]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / f"{api}-throughput.png").exists()
        assert (tmp_path / f"{api}-latency.png").exists()


def test_replot_draws_a_saved_result_again_without_sending(sb, tmp_path, monkeypatch):
    saved = tmp_path / "sweep.json"
    results = {"ours": {"levels": [{"level": 2, "output_tokens_per_s": 5.0}]}}
    workload = {"mode": "poisson_rate", "levels": [2.0]}
    saved.write_text(json.dumps({"workload": workload, "results": results}))
    drawn = []

    def plot(res, prefix, args):
        drawn.append((res, prefix, args.levels, args.rate))
        return [Path(f"{prefix}-throughput.png")]

    monkeypatch.setattr(sb, "plot", plot)
    monkeypatch.setattr(sb, "bench", lambda args: pytest.fail("a replot sends no request"))
    assert sb.main(["--replot", str(saved)]) == 0
    assert drawn == [(results, tmp_path / "sweep", [2.0], [2.0])]
    assert sb.main(["--replot", str(saved), "--plot", str(tmp_path / "other")]) == 0
    assert drawn[-1][1] == tmp_path / "other"
    with pytest.raises(SystemExit):  # nothing to do: said, not silently ignored
        sb.main(["--replot", str(saved), "--no-plot"])


def test_server_cpu_counts_a_process_tree_by_label(sb):
    from bench.proc_cpu import TreeCPU

    # the child says when it has burnt its 0.4 s of CPU (however long that takes here), then
    # waits to be measured
    burn = (
        "#burn\nimport time\nend = time.process_time() + 0.4\n"
        "while time.process_time() < end: pass\nprint('burnt', flush=True)\ntime.sleep(60)"
    )
    tree = TreeCPU([os.getpid()])  # this process and its descendants
    before = tree.snapshot()
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "burnt"
        spent = TreeCPU.spent(before, tree.snapshot())
    finally:
        child.kill()
        child.wait()
    label = next(label for label in spent if "#burn" in label)
    assert label.startswith(sys.executable) and spent[label] >= 0.3
    assert list(spent.values()) == sorted(spent.values(), reverse=True)
    assert TreeCPU.exists(os.getpid()) and not TreeCPU.exists(2**22 + 7)


def test_server_pid_must_exist(sb):
    with pytest.raises(SystemExit):
        sb.parse_args(["--server-pid=4194311"])
