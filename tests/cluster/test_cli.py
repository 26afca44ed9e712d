"""The README's commands, run as a user runs them: `make serve` (`python -m serve_app
deployments.yaml`), and on a started cluster `ray start --head`, `serve deploy
deployments-pd.yaml`, `serve status`, `serve shutdown`, `serve run`. Each test starts Ray of its
own in a subprocess (its own process group, stopped by id at the end), on copies of the YAMLs
that differ only in a free HTTP port, or, where a test is about how a command starts and stops,
also in the model (demo-tiny). Slow: a few minutes in all.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

import pytest
import yaml

from tests.processes import carrying
from tests.serve.serve_helpers import assert_freed_early, kv_idle, seconds_per_token

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
READY_S = 300  # Ray, the model and the embedding replicas loading on 2 cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config_copy(name: str, tmp_path: Path) -> tuple[Path, str]:
    """The YAML with only its HTTP port changed (a developer's server may hold 8000)."""
    spec = yaml.safe_load((ROOT / name).read_text())
    port = _free_port()
    spec["http_options"]["port"] = port
    path = tmp_path / Path(name).name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path, f"http://127.0.0.1:{port}"


def _env(**extra: str) -> dict:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    return {**env, **extra}


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _wait_ready(base: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + READY_S
    while _get(f"{base}/v2/health/ready") != 200:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the command exited ({process.returncode}) before it served")
        if time.monotonic() > deadline:
            raise AssertionError(f"{base} was not ready after {READY_S} s")
        time.sleep(1)


def _answers(base: str) -> None:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as response:
        model = json.loads(response.read())["data"][0]["id"]
    done = _post(f"{base}/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 4})
    assert done["usage"]["completion_tokens"] == 4
    chat = _post(
        f"{base}/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    )
    assert chat["choices"][0]["message"]["role"] == "assistant"


def _sigint_default() -> None:
    """A command started from a background job inherits SIGINT ignored (bash does that when job
    control is off, e.g. a CI script run with `&`), and `serve run` then never sees the Ctrl-C
    that _stop sends: it sat out the whole kill timeout."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_sigint_default,
        )  # fmt: skip


def _stop(process: subprocess.Popen, sig: int = signal.SIGINT, wait_s: float = 90) -> None:
    """Stop a command we started, by its process group: a signal it handles, then kill."""
    if process.poll() is None:
        os.killpg(process.pid, sig)
        try:
            process.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # what it left behind in its group
    except ProcessLookupError:
        pass
    process.wait(10)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


def test_ray_start_serve_deploy_status_shutdown_then_serve_run(tmp_path):
    """The README's cluster path: with RAY_AUTH_MODE=token exported (Ray 2.60's `ray start`
    turns token auth on; its CLI sends the token only in that mode), `serve deploy` of the PD
    file, `serve status`, `serve shutdown`; then `serve run` on the same cluster, stopped by
    Ctrl-C; one Ray start for both. Both files on the smallest model (the commands are the
    subject here: what deployments.yaml serves is the `make serve` test's, PD the serve
    tests')."""
    config, base = _small_config(tmp_path, "deployments-pd.yaml")
    dashboard = f"http://127.0.0.1:{_free_port()}"
    gcs = f"127.0.0.1:{_free_port()}"
    # (as docs/troubleshooting.md advises for `ray start` on a busy machine: the raylet waits
    # longer than 30 s for its dashboard agent, which the suite's other worker slows down)
    env = _env(RAY_AUTH_MODE="token", RAY_agent_register_timeout_ms="120000")
    log = tmp_path / "ray-start.log"
    # docs/serving.md's first step: with RAY_AUTH_MODE=token `ray start` refuses to start where
    # no token exists yet (a fresh machine); this makes ~/.ray/auth_token if it is missing
    token = subprocess.run(
        [str(BIN / "ray"), "get-auth-token", "--generate"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert token.returncode == 0, token.stderr[-2000:]
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    head = _start(
        [
            str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=2",
            f"--port={gcs.rsplit(':', 1)[1]}", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard.rsplit(':', 1)[1]}",
            f"--temp-dir={ray_dir}",  # short: Ray's socket paths must fit 107 bytes
        ],
        env, log,
    )  # fmt: skip

    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "serve"), *args, "--address", dashboard],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip

    try:
        try:
            deadline = time.monotonic() + 120
            # the dashboard answers HTTP before `serve deploy` can talk to it (each try of the
            # command costs a process start, seconds of CPU, while the cluster is starting)
            while _get(f"{dashboard}/api/version") == 0:
                assert time.monotonic() < deadline and head.poll() is None, "no dashboard"
                time.sleep(0.5)
            while (deployed := serve("deploy", str(config))).returncode != 0:
                assert time.monotonic() < deadline and head.poll() is None, deployed.stderr[-2000:]
                time.sleep(2)  # the dashboard is still starting its Serve module
            _wait_ready(base)
            status = serve("status")
            assert status.returncode == 0 and "RUNNING" in status.stdout, status.stderr[-2000:]
            _answers(base)
            down = serve("shutdown", "-y")
            assert down.returncode == 0, down.stderr[-2000:]
            deadline = time.monotonic() + 60
            while _get(f"{base}/health") == 200:  # the app goes away
                assert time.monotonic() < deadline, "the app still answers after serve shutdown"
                time.sleep(1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- ray start output ---\n{_tail(log)}") from None
        run_config, run_base = _small_config(tmp_path, "bench/demo.yaml")
        run_log = tmp_path / "serve-run.log"
        run_env = _env(RAY_AUTH_MODE="token", RAY_ADDRESS=gcs)
        run = _start([str(BIN / "serve"), "run", str(run_config)], run_env, run_log)
        try:
            _wait_ready(run_base, run)
            _answers(run_base)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- serve run output ---\n{_tail(run_log)}") from None
        finally:
            _stop(run)
    finally:
        # `ray start --block` takes ~30 s to wind down on SIGTERM; what is left of its process
        # group after 5 s is killed (its workers exit with the raylet)
        _stop(head, signal.SIGTERM, wait_s=5)
        shutil.rmtree(ray_dir, ignore_errors=True)


# -- `make serve`: python -m serve_app --------------------------------------------------------


def _serve_command(config: Path, tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path, str]:
    """`python -m serve_app config` as `make serve` runs it, with a variable of its own in its
    environment (and so in every process it starts) to find what it leaves behind."""
    marker = f"SERVE_APP_COMMAND_TEST={name}-{time.time_ns()}"
    key, value = marker.split("=")
    log = tmp_path / f"{name}.log"
    # RAY_ADDRESS=local: a Ray of its own even when another test's cluster runs on this machine
    env = _env(RAY_ADDRESS="local", **{key: value})
    process = _start([sys.executable, "-m", "serve_app", str(config)], env, log)
    return process, log, marker


def _wait_ready_line(process: subprocess.Popen, log: Path, base: str) -> None:
    deadline = time.monotonic() + READY_S
    while f"serve_app ready at {base}" not in log.read_text(errors="replace"):
        assert process.poll() is None, f"exited ({process.returncode}) before its ready line"
        assert time.monotonic() < deadline, f"no ready line after {READY_S} s"
        time.sleep(0.5)
    assert _get(f"{base}/v2/health/ready") == 200  # ready means ready


def _stops_on(process: subprocess.Popen, sig: int, marker: str, log: Path) -> None:
    """The signal stops the command within a minute, and nothing it started outlives it."""
    os.kill(process.pid, sig)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running 60 s after {signal.Signals(sig).name}:\n{_tail(log)}")
    deadline = time.monotonic() + 30  # Ray's workers exit shortly after its raylet
    while (left := carrying(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"left behind after {signal.Signals(sig).name}: {list(left.values())}"


def _metric(base: str, name: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
    )


def test_make_serve_answers_frees_a_dropped_stream_stops_and_quits_on_sigint(tmp_path):
    """The path every user takes first: `make serve` (python -m serve_app deployments.yaml,
    the ingress serving HTTP itself) prints its ready line, answers a chat, frees the KV of a
    stream its client dropped, stops a request by stopInfer, serves /metrics, and Ctrl-C
    (SIGINT) stops it with every process it started."""
    config, base = _config_copy("deployments.yaml", tmp_path)
    process, log, marker = _serve_command(config, tmp_path, "sigint")
    try:
        _wait_ready_line(process, log, base)
        # the model replica's ready line says what num_cpus auto reserved for it
        assert re.search(r"ready on .*\d CPUs? reserved from Ray", log.read_text()), _tail(log)
        _off_the_engines_cores(marker)
        model = "smollm2-135m-instruct"
        chat = _post(f"{base}/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "What is the capital of "
            "France?"}], "max_tokens": 16, "top_k": 1})  # fmt: skip
        assert "Paris" in chat["choices"][0]["message"]["content"]
        # a stream of up to maxIterTimes (512) tokens, dropped after its first event: the KV
        # pool is idle again long before those tokens could have been generated
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 512,
                "ignore_eos": True, "stream": True}  # fmt: skip
        request = urllib.request.Request(
            f"{base}/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        s_per_token = seconds_per_token(base, 32)
        with urllib.request.urlopen(request, timeout=60) as stream:
            assert stream.readline().startswith(b"data: ")
        dropped_at = time.monotonic()

        assert_freed_early(partial(kv_idle, base), dropped_at, 511, s_per_token)
        # stopInfer ends a running request by its id
        stopped: dict = {}

        def stop_soon() -> None:
            for _ in range(100):
                time.sleep(0.1)
                try:
                    stopped["answer"] = _post(f"{base}/v2/models/{model}/stopInfer", {"id": "s 1"})
                    return
                except urllib.error.HTTPError:  # not running yet
                    continue

        stopper = threading.Thread(target=stop_soon)
        stopper.start()
        generate = {"id": "s 1", "text_input": "Count to a thousand:", "max_tokens": 500,
                    "ignore_eos": True, "details": True}  # fmt: skip
        answer = _post(f"{base}/v2/models/{model}/generate", generate)
        stopper.join()
        assert stopped.get("answer") == {"id": "s 1"}
        assert answer["details"]["finish_reason"] == "stop_sequence"
        assert answer["details"]["generated_tokens"] < 500
        assert _metric(base, "request_received_total") >= 3
    except AssertionError as exc:
        _stop(process)
        raise AssertionError(f"{exc}\n--- python -m serve_app output ---\n{_tail(log)}") from None
    try:
        _stops_on(process, signal.SIGINT, marker, log)
    finally:
        _stop(process)


def _off_the_engines_cores(marker: str) -> None:
    """Once it is up, no thread of Ray's processes or the replicas runs on the engine process's
    cores (engineCpus auto: on 2 cores or more the engine has cores of its own); while it
    started they loaded on every core."""
    started = carrying(marker)
    (engine,) = [pid for pid, command in started.items() if "_child_main" in command]
    engine_cores = os.sched_getaffinity(engine)
    if engine_cores == os.sched_getaffinity(0):
        return  # one core: nothing is bound
    for pid, command in started.items():
        if pid != engine:
            assert not any(cores & engine_cores for cores in _thread_cores(pid)), command


def _thread_cores(pid: int) -> list[set[int]]:
    """The cores each thread of the process may run on (those that end meanwhile left out)."""
    found = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                found.append(os.sched_getaffinity(int(tid)))
    return found


def _small_config(tmp_path: Path, name: str) -> tuple[Path, str]:
    """The YAML on the smallest app (demo-tiny, its engine in the replica, no embeddings), for
    the commands whose subject is how they start and stop, not what they serve:
    deployments.yaml itself is served whole by the `make serve` test."""
    config, base = _config_copy(name, tmp_path)
    spec = yaml.safe_load(config.read_text())
    args = spec["applications"][0]["args"]
    args.pop("EmbeddingConfig", None)
    (model,) = args["BackendConfig"]["ModelDeployConfig"]["ModelConfig"]
    model.update(
        modelWeightPath="demo-tiny", engineProcess=False, engineCpus="", engineSpareCpus=""
    )
    args["BackendConfig"]["ScheduleConfig"]["kvCacheBlocks"] = 64
    config.write_text(yaml.safe_dump(spec, sort_keys=False))
    return config, base


def test_make_serve_quits_on_sigterm(tmp_path):
    """SIGTERM (`kill`, a service manager's stop) stops it as Ctrl-C does, leaving nothing.
    On the smallest app: the stop, with an engine process and an embedding replica among what
    it stops, is the test above's."""
    config, base = _small_config(tmp_path, "bench/demo.yaml")
    process, log, marker = _serve_command(config, tmp_path, "sigterm")
    try:
        _wait_ready_line(process, log, base)
        _stops_on(process, signal.SIGTERM, marker, log)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- python -m serve_app output ---\n{_tail(log)}") from None
    finally:
        _stop(process)
