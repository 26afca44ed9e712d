"""The CPU kernels' other instruction-set branches, checked against torch on this machine.

The kernels are built for the CPU they run on (-march=native), so a suite on an AVX-512 machine
would only ever check the AVX-512 branches, and one on an AVX2 machine only the AVX2 ones. Here
the kernel tests also run against a build for another instruction set this CPU can execute
(SERVE_APP_CPU_KERNELS_ARCH, in a process of its own: a process loads one build): the AVX2 and
FMA branches (haswell) on an AVX-512 machine, the branches without AVX (x86-64-v2) on an AVX2
one. Slow: the other build compiles first (into the model cache, once per machine kind)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.engine.backends.cpu import kernels as cpu_kernels
from serve_app.engine.backends.device import cpu_flags

ROOT = Path(__file__).resolve().parents[2]
# the tests whose kernels branch on the instruction set: paged attention, the streamed GEMM and
# its epilogues, the argmax, the norm and rotary
KERNEL_TESTS = [
    "tests/engine/test_cpu_kernels.py::test_matches_attention_over_the_gathered_cache",
    "tests/engine/test_cpu_kernels.py::test_prompts_attend_through_the_kernel_as_the_masked_path_does",
    "tests/engine/test_cpu_kernels.py::test_rms_norm_is_transformers_rmsnorm",
    "tests/engine/test_cpu_kernels.py::test_rotary_in_place_is_transformers_rotary",
    "tests/engine/test_cpu_gemm.py::test_streamed_linear_matches_nn_linear",
    "tests/engine/test_cpu_gemm.py::test_the_fused_forms_match_their_unfused_ops",
    "tests/engine/test_cpu_gemm.py::test_the_up_projection_applies_silu_to_the_gate_as_it_writes",
    "tests/engine/test_sampler.py::test_row_argmax_is_torch_argmax",
]


def other_arch() -> str | None:
    """The instruction set to check besides this CPU's own, or None (not x86)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    return "haswell" if "avx512f" in cpu_flags() else "x86-64-v2"


@pytest.mark.timeout(600)
@pytest.mark.skipif(other_arch() is None, reason="x86 only: the branches are x86's")
@pytest.mark.skipif(cpu_kernels.op("argmax_rows") is None, reason="the CPU kernels are not built")
def test_the_kernels_built_for_another_instruction_set_match_torch():
    arch = other_arch()
    env = {**os.environ, cpu_kernels.ARCH_SWITCH: arch}
    env.pop("PYTEST_XDIST_WORKER", None)
    probe = (
        "from serve_app.engine.backends.cpu import kernels as k\n"
        "print(k._build_dir().name, k.op('argmax_rows') is not None)"
    )
    built = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    name, loaded = built.stdout.split()
    assert loaded == "True", built.stderr[-3000:]
    assert name != cpu_kernels._build_dir().name  # another build than this process's
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         *KERNEL_TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, f"{arch} build:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]
