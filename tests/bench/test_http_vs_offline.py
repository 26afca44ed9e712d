"""bench/http_vs_offline.py: the pairs run end to end against stand-ins (a server process that
says it is ready and streams like ours, an offline run that writes bench/engine.py's report),
and the pieces a real run relies on: the server's config, the order, the summary."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import yaml


@pytest.fixture(scope="module")
def hvo(load_bench):
    return load_bench("http_vs_offline")


@pytest.fixture(scope="module")
def sp(hvo):
    """bench/server_process.py, the module that starts and stops the servers it measures."""
    return sys.modules[hvo.start_server.__module__]


SPEC = {
    "proxy_location": "HeadOnly",
    "http_options": {"host": "127.0.0.1", "port": 8000},
    "applications": [
        {
            "name": "serve_app",
            "args": {
                "BackendConfig": {
                    "ModelDeployConfig": {
                        "ModelConfig": [
                            {"modelName": "demo", "modelWeightPath": "demo"},
                            {"modelName": "other", "modelWeightPath": "/w", "dtype": "auto"},
                        ]
                    }
                }
            },
        }
    ],
}


def stand_in_server(tmp_path, monkeypatch, sp, body: str):
    """Makes the bench start `body` (a Python script given the config's path) as the server."""
    script = tmp_path / "stand_in_server.py"
    script.write_text(textwrap.dedent(body))
    command = [sys.executable, str(script)]
    monkeypatch.setattr(sp, "server_command", lambda config: [*command, str(config)])


def test_pairs_end_to_end(hvo, sp, tmp_path, monkeypatch, capsys):
    # the server: bench/sse_floor.py's bare SSE app on the config's port (any GET answers 200)
    stand_in_server(
        tmp_path,
        monkeypatch,
        sp,
        f"""
        import sys, yaml
        sys.path.insert(0, {str(hvo.ROOT)!r})
        from bench import sse_floor
        port = yaml.safe_load(open(sys.argv[1]))["http_options"]["port"]
        sse_floor.serve("bare", port, 0.005)
    """,
    )
    # offline: bench/engine.py's report, with the figure growing from run to run
    runs = tmp_path / "runs"
    fake_engine = f"""
        import json, pathlib, sys
        runs = pathlib.Path({str(runs)!r}); runs.mkdir(exist_ok=True)
        n = len(list(runs.iterdir())); (runs / str(n)).touch()
        out = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--out=")][0]
        ours = {{"tokens_per_s": 1000.0 + 100 * n, "runs_s": [1.0]}}
        report = {{"results": {{"float32": {{"systems": {{"ours": ours}}}}}}}}
        pathlib.Path(out).write_text(json.dumps(report))
    """
    engine = tmp_path / "fake_engine.py"
    engine.write_text(textwrap.dedent(fake_engine))
    seen = []

    def offline_command(weights, dtype, args, out):
        seen.append((weights, dtype, args.concurrency, args.prompt_len, args.output_len))
        return [sys.executable, str(engine), f"--out={out}"]

    monkeypatch.setattr(hvo, "offline_command", offline_command)
    monkeypatch.setattr(hvo, "prompt_vocab", lambda weights: 5000)
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(SPEC))
    out = tmp_path / "hvo.json"
    argv = [f"--config={config}", "--dtype=float32", "--pairs=2", "--concurrency=2",
            "--prompt-len=1", "--output-len=4", "--duration=1.5", "--repeats=1", "--settle=0",
            f"--out={out}"]  # fmt: skip
    assert hvo.main(argv) == 0

    assert seen == [("demo", "float32", 2, 1, 4)] * 2  # the config's first model, same workload
    report = json.loads(out.read_text())
    assert report["workload"]["dtype"] == "float32" and report["workload"]["model"] == "demo"
    assert report["workload"]["prompt_ids_below"] == 5000 and "incomplete" not in report
    pairs = report["pairs"]
    assert [p["order"] for p in pairs] == [["http", "offline"], ["offline", "http"]]
    assert [p["offline_tok_s"] for p in pairs] == [1000.0, 1100.0]
    for p in pairs:
        http = p["http"]
        assert http["errors"] == 0, http["error_samples"]
        assert http["completed"] >= 2 and http["output_tokens"] == 4 * http["completed"]
        assert http["server_cpu_us_per_token"] > 0  # the server's process tree, measured
        assert p["ratio"] == pytest.approx(p["http_tok_s"] / p["offline_tok_s"])
        cpu = p["cpu_us_per_token"]  # the stand-in server is one process: the busiest
        assert cpu["busiest_us"] == pytest.approx(http["server_cpu_us_per_token"])
        assert cpu["rest_of_server_us"] == 0 and cpu["client_us"] > 0
        assert 0 < cpu["busiest_share"] < 1
    summary = report["summary"]
    mean_http = sum(p["http_tok_s"] for p in pairs) / 2
    assert summary["ratio_of_means"] == pytest.approx(mean_http / 1050.0)
    assert summary["pair_ratio_min"] <= summary["ratio_of_means"] <= summary["pair_ratio_max"]
    shares = [p["cpu_us_per_token"]["busiest_share"] for p in pairs]
    assert summary["busiest_share_mean"] == pytest.approx(sum(shares) / 2)
    table = capsys.readouterr().out
    assert "HTTP/offline" in table and "share" in table and "\nmean " in table


def test_a_failed_pair_keeps_the_pairs_before_it(hvo, sp, tmp_path, monkeypatch, capsys):
    """The second server fails to start: the error names it with its output, and the first
    pair is written, marked incomplete. A server whose requests fail stops the run too."""
    starts = tmp_path / "starts"
    stand_in_server(
        tmp_path,
        monkeypatch,
        sp,
        f"""
        import http.server, json, pathlib, sys, yaml
        starts = pathlib.Path({str(starts)!r}); starts.mkdir(exist_ok=True)
        n = len(list(starts.iterdir())); (starts / str(n)).touch()
        if n == 1:
            print("model folder not found: /nowhere", flush=True)
            sys.exit(3)
        port = yaml.safe_load(open(sys.argv[1]))["http_options"]["port"]

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # /v2/health/ready: ready
                self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")
            def do_POST(self):  # every request fails after the first start's
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(500 if n > 1 else 200)
                self.send_header("Content-Type", "text/event-stream"); self.end_headers()
                if n == 0:
                    event = {{"choices": [{{"index": 0, "text": "x"}}],
                              "usage": {{"completion_tokens": 1, "prompt_tokens": 1}}}}
                    self.wfile.write(b"data: " + json.dumps(event).encode() + b"\\n\\n")
                    self.wfile.write(b"data: [DONE]\\n\\n")
            def log_message(self, *args):
                pass

        http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """,
    )
    monkeypatch.setattr(hvo, "measure_offline", lambda *a: {"output_tokens_per_s": 10.0})
    monkeypatch.setattr(hvo, "prompt_vocab", lambda weights: 5000)
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(SPEC))
    out = tmp_path / "x.json"
    argv = [f"--config={config}", "--dtype=float32", "--pairs=3", "--duration=1",
            "--concurrency=1", "--settle=0", f"--out={out}"]  # fmt: skip
    assert hvo.main(argv) == 1
    err = capsys.readouterr().err
    assert "exited with 3 before it was ready" in err and "model folder not found" in err
    report = json.loads(out.read_text())
    assert report["incomplete"] is True and len(report["pairs"]) == 1
    assert report["pairs"][0]["http"]["completed"] >= 1

    out.unlink()  # the third start serves, but every request fails: no figure from it
    assert hvo.main([*argv[:2], "--pairs=1", *argv[3:]]) == 1
    assert "requests over HTTP failed" in capsys.readouterr().err
    assert not out.exists()


def test_server_config(sp):
    spec = sp.server_config(SPEC, "bfloat16")
    assert [m["dtype"] for m in sp.models_of(spec)] == ["bfloat16", "bfloat16"]
    assert "dtype" not in sp.models_of(SPEC)[0]  # the user's config is left as it was
    assert sp.server_config(SPEC, None) == SPEC
    assert sp.first_model(SPEC) == ("demo", "demo", "auto")
    with pytest.raises(SystemExit):
        sp.first_model({"applications": [{"args": {}}]})
    assert sp.resolved_dtype("float32") == "float32"
    assert sp.resolved_dtype("auto") in ("float32", "bfloat16")


def test_the_server_gets_a_free_port_and_is_reached_on_its_host(sp, tmp_path, monkeypatch):
    monkeypatch.setattr(sp, "server_command", lambda config: [sys.executable, "-c", "pass"])
    for host, reached in (("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("::1", "[::1]")):
        spec = {**SPEC, "http_options": {"host": host, "port": 8000}}
        process, url = sp.start_server(spec, tmp_path / "server.log")
        process.wait(timeout=30)
        written = yaml.safe_load((tmp_path / "server.yaml").read_text())
        port = written["http_options"]["port"]
        assert port != 8000 and written["http_options"]["host"] == host
        assert url == f"http://{reached}:{port}"
        assert written["applications"] == SPEC["applications"]
    assert SPEC["http_options"]["port"] == 8000  # the user's config is left as it was


def test_cpu_split(hvo):
    by_process = {"engine": 1.0, "ingress": 0.08, "replica": 0.07}
    http = {"output_tokens": 1000, "client_cpu_s": 0.05, "server_cpu_by_process_s": by_process}
    cpu = hvo.cpu_split(http)
    assert cpu["busiest_process"] == "engine" and cpu["busiest_us"] == pytest.approx(1000)
    assert cpu["rest_of_server_us"] == pytest.approx(150) and cpu["client_us"] == pytest.approx(50)
    assert cpu["busiest_share"] == pytest.approx(1000 / 1200)
    assert hvo.cpu_split({"output_tokens": 10, "client_cpu_s": 0.1}) is None  # no server CPU
    assert hvo.cpu_split({**http, "output_tokens": 0}) is None


def test_order_and_summary(hvo):
    assert [hvo.order(i)[0] for i in range(4)] == ["http", "offline", "http", "offline"]
    pairs = [{"http_tok_s": 80.0, "offline_tok_s": 100.0, "ratio": 0.8},
             {"http_tok_s": 90.0, "offline_tok_s": 100.0, "ratio": 0.9}]  # fmt: skip
    summary = hvo.summarize(pairs)
    assert summary["ratio_of_means"] == pytest.approx(0.85)
    assert (summary["pair_ratio_min"], summary["pair_ratio_max"]) == (0.8, 0.9)
    assert summary["busiest_share_mean"] is None  # no CPU figures


def test_arguments(hvo, tmp_path):
    args = hvo.parse_args([])
    assert args.config.name == "demo.yaml" and args.pairs == 3 and args.concurrency == 32
    for bad in (["--pairs=0"], ["--duration=0"], ["--concurrency=0"], ["--settle=-1"],
                [f"--config={tmp_path / 'missing.yaml'}"], ["--dtype=int8"]):  # fmt: skip
        with pytest.raises(SystemExit):
            hvo.parse_args(bad)


def test_stopping_waits_for_the_whole_session(sp, tmp_path, monkeypatch):
    """Ray's processes outlive the server's own for a while: the offline run must not start
    beside them; what is still there when the stop's time is up is killed."""
    import time

    monkeypatch.setattr(sp, "STOP_TIMEOUT_S", 3.0)
    for lasts in (0.5, 60.0):  # a child of the server's that ends soon after it, or never
        ready = tmp_path / f"child-{lasts}"  # the child ignores the stop's Ctrl-C from here on
        child = (
            f"import pathlib, signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            f"pathlib.Path({str(ready)!r}).touch(); time.sleep({lasts})"
        )
        server = textwrap.dedent(f"""
            import subprocess, sys, time
            subprocess.Popen([sys.executable, "-c", {child!r}])
            time.sleep(60)
        """)
        # started as a server is (in a session of its own, Ctrl-C restored: under a background
        # job the test itself may run with SIGINT ignored)
        monkeypatch.setattr(
            sp, "server_command", lambda config, s=server: [sys.executable, "-c", s]
        )
        process, _ = sp.start_server({}, tmp_path / f"server-{lasts}.log")
        deadline = time.monotonic() + 10
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(sp.session_processes(process.pid)) == 2
        start = time.monotonic()
        sp.stop_server(process)
        took = time.monotonic() - start
        assert sp.session_processes(process.pid) == []
        assert (0.1 < took < 3.0) if lasts < 3 else (3.0 <= took < 6.0), (lasts, took)
