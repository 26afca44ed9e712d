"""The container images (cluster/images/): the CPU one is built and serves a chat answer where a
container runtime can build it; everywhere, both carry what the install and the cluster files
expect of them."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "cluster" / "images"
CPU, ASCEND = IMAGES / "cpu.Dockerfile", IMAGES / "ascend.Dockerfile"


def test_the_cpu_image_installs_as_make_serve_does_and_serves_on_every_interface():
    text = CPU.read_text(encoding="utf-8")
    assert "RUN make .venv/.installed-serve" in text  # the Makefile's own install step
    assert re.search(r"ENTRYPOINT .*\"--host\", \"0.0.0.0\"", text)
    assert "download.pytorch.org/whl/cpu" in text  # torch's CPU build, not PyPI's CUDA one
    for copied in re.findall(r"^COPY (.+) \./?\S*$", text, re.M):
        for name in copied.split():
            assert (ROOT / name).exists(), name


def test_the_ascend_image_pins_a_torch_pair_and_the_kuberay_manifest_names_it():
    text = ASCEND.read_text(encoding="utf-8")
    torch = re.search(r"ARG TORCH=(\S+)", text).group(1)
    npu = re.search(r"ARG TORCH_NPU=(\S+)", text).group(1)
    assert npu.split(".post")[0] == torch  # torch_npu X.Y.Z goes with torch X.Y.Z
    assert '".[serve,ascend]"' in text and "set_env.sh" in text
    manifest = (ROOT / "cluster" / "kuberay-rayservice.yaml").read_text(encoding="utf-8")
    assert "cluster/images/ascend.Dockerfile" in manifest


def _docker_can_build() -> str | None:
    """Why the CPU image cannot be built here (None: it can)."""
    if shutil.which("docker") is None:
        return "no container runtime (docker) on this machine"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    if info.returncode != 0:
        return f"docker cannot reach its daemon: {info.stderr.strip().splitlines()[-1][:200]}"
    pull = subprocess.run(
        ["docker", "pull", "python:3.11-slim"], capture_output=True, text=True, timeout=600
    )
    if pull.returncode != 0:
        return "the base image python:3.11-slim cannot be pulled (no registry reachable)"
    return None


@pytest.mark.timeout(3600)
def test_the_cpu_image_builds_and_answers_a_chat():
    why = _docker_can_build()
    if why:
        pytest.skip(why)
    tag = "serve-app-test:cpu"
    build = subprocess.run(
        ["docker", "build", "-f", str(CPU), "-t", tag, str(ROOT)],
        capture_output=True, text=True, timeout=3000,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run(
        ["docker", "run", "-d", "--rm", "-p", "127.0.0.1::8000", "--shm-size=2g", tag],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    container = run.stdout.strip()
    try:
        port = (
            subprocess.run(
                ["docker", "port", container, "8000"], capture_output=True, text=True, check=True
            )
            .stdout.split(":")[-1]
            .strip()
        )
        body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4}  # fmt: skip
        deadline = time.monotonic() + 600
        while True:
            try:
                reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
                if reply.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the container did not serve within 600 s"
            time.sleep(2)
        assert reply.json()["choices"][0]["message"]["content"]
    finally:
        subprocess.run(["docker", "stop", container], capture_output=True, timeout=120)
