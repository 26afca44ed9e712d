"""Our server as a benchmark's child process: `python -m serve_app` on a copy of a Serve config
with a free port, in a session of its own; waited for until every model replica is ready, and
stopped with every process it started (Ray's, the engine processes), so that what the bench
measures next does not share the cores with a server going away."""

from __future__ import annotations

import contextlib
import copy
import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from bench.common import log
from bench.peers import free_port
from bench.proc_cpu import session_processes

ROOT = Path(__file__).resolve().parent.parent
STOP_TIMEOUT_S = 90.0  # Ctrl-C to gone; then what is left is killed
START_TIMEOUT_S = 600.0  # a first start builds the demo model into its cache


def server_config(spec: dict, dtype: str | None) -> dict:
    """The Serve config `spec` with, if given, every model in `dtype`."""
    spec = copy.deepcopy(spec)
    if dtype is not None:
        for model in models_of(spec):
            model["dtype"] = dtype
    return spec


def models_of(spec: dict) -> list[dict]:
    """Every ModelConfig entry of every application of a Serve config."""
    out = []
    for app in spec.get("applications") or []:
        backend = (app.get("args") or {}).get("BackendConfig") or {}
        out.extend((backend.get("ModelDeployConfig") or {}).get("ModelConfig") or [])
    return out


def first_model(spec: dict) -> tuple[str, str, str]:
    """(modelName, modelWeightPath, dtype) of the config's first model."""
    models = models_of(spec)
    if not models:
        raise SystemExit("the config has no BackendConfig.ModelDeployConfig.ModelConfig entry")
    model = models[0]
    return model["modelName"], model["modelWeightPath"], model.get("dtype", "auto")


def resolved_dtype(name: str) -> str:
    """A config's dtype as the engine resolves it on this machine's CPU ("auto": bfloat16
    where the CPU has bfloat16 arithmetic)."""
    import torch

    from serve_app.engine.backends.device import pick_dtype

    return str(pick_dtype(name, torch.device("cpu"))).removeprefix("torch.")


def server_command(config: Path) -> list[str]:
    return [sys.executable, "-m", "serve_app", str(config)]


def start_server(spec: dict, log_path: Path) -> tuple[subprocess.Popen, str]:
    """The server of the Serve config `spec` on a free port (the config is written next to
    `log_path`, which gets its output); its base URL, on the config's host or on 127.0.0.1
    where it listens on every address."""
    spec = copy.deepcopy(spec)
    port = free_port()
    spec["http_options"] = {**(spec.get("http_options") or {}), "port": port}
    config = log_path.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(spec, sort_keys=False))
    host = spec["http_options"].get("host")
    host = "127.0.0.1" if host in (None, "", "0.0.0.0", "::") else host
    host = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
    with log_path.open("wb") as out:
        process = subprocess.Popen(
            server_command(config), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
            # Ctrl-C must reach it even when the bench runs as a background job (which inherits
            # SIGINT ignored where job control is off)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
    return process, f"http://{host}:{port}"


def wait_ready(url: str, timeout_s: float, process: subprocess.Popen | None,
               log_path: Path | None = None, poll_s: float = 1.0) -> None:  # fmt: skip
    """Until `url` says every model replica is ready (/v2/health/ready, asked every `poll_s`);
    an error if the server exits first (with the end of its output, from `log_path`) or takes
    too long. `process` None: a server this bench did not start as a process."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"the server exited with {process.returncode} before it was ready; the end of "
                f"its output ({log_path}):\n{tail(log_path)}"
            )
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5) as response:
                if response.status == 200:
                    return
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s:\n{tail(log_path)}")


def stop_server(process: subprocess.Popen) -> None:
    """Ctrl-C to the server's process group (it shuts Serve and Ray down), then waits until
    every process of its session is gone (Ray's workers and the engine processes end after
    it); what is left after STOP_TIMEOUT_S is killed."""
    if process.poll() is None:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGINT)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_TIMEOUT_S)
    while (left := session_processes(process.pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if process.poll() is None or left:
        log(f"the server did not stop within {STOP_TIMEOUT_S:g} s: killing what is left of it")
        with contextlib.suppress(OSError):
            process.kill()
        process.wait()
        deadline = time.monotonic() + 10.0  # a killed process takes a moment to be gone
        while (left := session_processes(process.pid)) and time.monotonic() < deadline:
            for pid in left:  # scanned again each time: none started since is missed
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        if left:
            raise RuntimeError(f"processes {left} of the stopped server would not end")


def tail(path: Path | None, lines: int = 20) -> str:
    if path is None:
        return "(its output not kept)"
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"
