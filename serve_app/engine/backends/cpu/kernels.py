"""The engine's own CPU kernels (serve_app/engine/backends/cpu/csrc), compiled on first use.

`op(name)` returns torch.ops.serve_app_cpu.<name>, or None where the kernels cannot be had: no
C++ compiler or ninja on the machine, a failed build, or SERVE_APP_CPU_KERNELS=0. Then the
engine keeps its portable torch path and logs why once. The ops (their schemas: csrc/ops.cpp):

- `paged_decode_attention` (`paged_decode_attention()`): decode attention that reads keys and
  values in place in the paged cache (else: gather them, then torch's sdpa);
- `rms_norm`, `rotary_`: a fused layer's RMSNorm and rotary embedding in one pass each (else:
  torch's rms_norm and the eager rotary ops; layers.py).
- `argmax_rows`: greedy sampling's argmax over a step's float32 or bfloat16 logits, exactly
  torch.argmax (else: a chunked torch argmax over float32 logits; argmax.row_argmax).
- `streamed_linear`: a GEMM that streams its weight, the multiplication overlapping the
  weight's arrival, with the bias and a residual add or a product applied as it writes: the LM
  head and the fused decoder layers' projections, in float32, and in bfloat16 but on CPUs with
  AMX (cpu_gemm.StreamedLinear; else: oneDNN's prepacked GEMM). Built on CPUs with AVX-512 or
  with AVX2 and FMA, where it was measured; `op` says None elsewhere. `streamed_bf16_pairs`:
  whether this build multiplies bfloat16 with AVX512-BF16 dot products, on weights packed in
  pairs of k (cpu_gemm.bf16_pairs). `zeros_on_huge_pages`: the zeroed memory StreamedLinear
  packs its weight into and the CPU KV cache lives in (backends/runner.py), on 2 MiB pages where
  the Linux kernel gives them (fewer TLB misses while a step streams the weights and reads the
  cache; csrc/huge_pages.cpp).
- `use_spare_cpus`, `spare_cores_stats`: helper threads on spare cores, at idle priority, that
  share the streamed GEMMs, decode attention and the greedy argmax with the calling thread
  (csrc/spare_cores.h; spare_cores.lend_spare_cores), and how many chunks the caller, the helpers
  and the caller again (late helpers) computed, how many jobs the helpers found awake
  (spinning after the last one) or only after sleeping, and how many parts of the chunks
  taken back a helper had already put in place.

The build needs a C++ compiler (g++ or clang++) and ninja (installed with the project from
PyPI). It compiles the sources as one unit (some 20 s of one core), is tuned to the machine's
CPU (-march=native, or the instruction set SERVE_APP_CPU_KERNELS_ARCH names) and is kept in the
model cache under kernels/<fingerprint of the CPU, torch, the flags and the sources>, so every
later process, replica and engine process on the machine loads it in milliseconds. `make
install` builds it ahead of time (`python -m serve_app.engine.backends.cpu.kernels`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path

import torch

from serve_app.engine.backends.device import cpu_flags

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [
    CSRC / name
    for name in (
        "paged_decode_attention.cpp", "layer_ops.cpp", "argmax.cpp", "streamed_gemm.cpp",
        "spare_cores.cpp", "huge_pages.cpp", "ops.cpp",
    )
]  # fmt: skip
# included by the sources: part of the fingerprint
HEADERS = sorted(CSRC.glob("*.h"))
ENV_SWITCH = "SERVE_APP_CPU_KERNELS"
# the instruction set the build targets (-march on x86, -mcpu elsewhere): this CPU's unless set,
# e.g. "haswell" (AVX2 and FMA, no AVX-512) for nodes of several CPU generations, or to check
# the AVX2 branches on an AVX-512 machine (the suite does)
ARCH_SWITCH = "SERVE_APP_CPU_KERNELS_ARCH"
LIBRARY = "serve_app_cpu_kernels"
_lock = threading.Lock()
_state: dict[str, object] = {}


def _fingerprint() -> str:
    """The CPU's feature flags, the torch build and the sources: a build is reused only on the
    machine kind it was tuned for."""
    digest = hashlib.sha256()
    flags = cpu_flags()
    digest.update(f"{platform.machine()}|{flags}|{torch.__version__}|{_cflags()}".encode())
    for source in [*SOURCES, *HEADERS]:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def _build_dir() -> Path:
    from serve_app.models.cache import cache_root

    return cache_root() / "kernels" / _fingerprint()


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the PyPI package puts it in the venv's bin, which
    is not on PATH when the venv's python is run directly."""
    if shutil.which("ninja"):
        return
    try:
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    except ImportError:
        pass


def _cflags() -> list[str]:
    flags = ["-O3", "-fopenmp"]  # at::parallel_for is OpenMP in torch's CPU builds
    arch = os.environ.get(ARCH_SWITCH) or "native"
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append(f"-march={arch}")
    else:
        flags.append(f"-mcpu={arch}")
    return flags


def _one_unit(build: Path) -> Path:
    """The sources as one translation unit (a file in the build folder that includes them):
    each source alone spends most of its compile parsing the same ATen headers, so one unit
    costs about a third of the CPU of compiling them apart (a rebuild is the whole unit)."""
    unit = build / f"{LIBRARY}_unit.cpp"
    unit.write_text("".join(f'#include "{source}"\n' for source in SOURCES))
    return unit


def _load() -> None:
    """Load the finished build of this fingerprint, or build it first. A finished build is
    loaded as it is, without asking ninja again: ninja rebuilds whenever the ninja that asks
    differs from the one that built (a venv's ninja and the system's keep different logs), which
    made every engine start on machines with both compile the kernels again
    (docs/performance.md, "Packed and streamed GEMMs")."""
    from torch.utils import cpp_extension

    build = _build_dir()
    library, done = build / f"{LIBRARY}.so", build / "built"
    if done.exists() and library.exists():
        torch.ops.load_library(str(library))
        return
    _ninja_on_path()
    build.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=LIBRARY,
        sources=[str(_one_unit(build))],
        extra_cflags=_cflags(),
        extra_ldflags=["-fopenmp"],  # libgomp: the one torch has loaded already (same soname)
        build_directory=str(build),
        is_python_module=False,
        verbose=False,
    )
    done.touch()  # only now: a process that starts while this one links waits for the build


def _loaded() -> bool:
    """Build or load the kernels once per process; False (the reason logged once) if not."""
    with _lock:
        if "loaded" not in _state:
            reason = ""
            if os.environ.get(ENV_SWITCH, "1") == "0":
                reason = f"{ENV_SWITCH}=0"
            else:
                try:
                    _load()
                except Exception as exc:  # no compiler, no ninja, a failed build
                    reason = f"{type(exc).__name__}: {str(exc).strip()[-500:]}"
            if reason:
                log.warning(
                    "CPU kernels not used (%s): decode attention gathers the cached keys and "
                    "values instead (slower at long contexts), norms and rotary run as torch ops",
                    reason,
                )
            _state["loaded"] = not reason
        return bool(_state["loaded"])


def op(name: str):
    """torch.ops.serve_app_cpu.<name>, or None where the kernels cannot be had or this CPU's
    build has no such op."""
    return getattr(torch.ops.serve_app_cpu, name, None) if _loaded() else None


def paged_decode_attention():
    """The compiled decode attention, or None."""
    return op("paged_decode_attention")


def build() -> None:
    """Build (or find) the kernels now and say so: `make install` runs this ahead of first use."""
    logging.basicConfig(level=logging.INFO)
    print("CPU kernels:", "built" if _loaded() else "not built (see the warning above)")


if __name__ == "__main__":
    build()
