"""What the benchmarks share: random prompts, percentiles and token gaps, the machine and load
a run is measured on, the progress log and the JSON result's common head.

A result goes to bench/results/<bench>/<machine kind>/<date>[-<label>].json unless `--out`
says otherwise, and records the commit, the command line, the machine and the date.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# The demo tokenizer's ids below this are regular BPE tokens (the special tokens follow).
VOCAB_REGULAR = 151643
T0 = time.perf_counter()


def log(message: str, tag: str = "") -> None:
    """A progress line stamped with the seconds since the benchmark started (and a tag)."""
    where = f" {tag}" if tag else ""
    print(f"[{time.perf_counter() - T0:6.1f}s{where}] {message}", flush=True)


# -- prompts ------------------------------------------------------------------------------------


def seeded_prompts(num: int, length: int, seed: int, vocab: int = VOCAB_REGULAR) -> list[list[int]]:
    """`num` prompts of `length` token ids uniform below `vocab` (default: the demo tokenizer's
    regular tokens), from a torch.Generator(seed)."""
    import torch  # only the engine benchmark needs torch in its own process

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=gen).tolist()


def prompt_vocab(model_path: Path) -> int:
    """Prompt ids are drawn below this: the demo tokenizer's regular tokens, else the vocab."""
    vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    return min(vocab, VOCAB_REGULAR)


def random_token_ids(rng: random.Random, length: int, vocab: int = VOCAB_REGULAR) -> list[int]:
    """One prompt of `length` uniform random token ids below `vocab` (default: the demo
    tokenizer's regular tokens) drawn from `rng`."""
    return [rng.randrange(vocab) for _ in range(length)]


# -- statistics ---------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) of values, linearly interpolated between neighbours."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def percentile_ms(values: list[float], q: float) -> float | None:
    """The q-quantile of values in seconds, as milliseconds; None when there are none."""
    return 1e3 * percentile(values, q) if values else None


def gaps(times: list[float]) -> list[float]:
    """The differences between consecutive timestamps."""
    return [b - a for a, b in zip(times, times[1:], strict=False)]


# -- the machine --------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def usable_cores() -> int | None:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def machine_info(packages: tuple[str, ...], **extra) -> dict:
    """CPU, usable cores, the given packages' versions, Python, the platform, the machine's kind
    (its results' folder), then `extra`."""
    versions = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable_cores(),
        **versions,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "kind": machine_kind(),
        **extra,
    }


# Where /proc/cpuinfo's model name carries no model number (a cloud VM's "AMD EPYC" or "Intel(R)
# Xeon(R) Processor"), the family and model numbers tell the generation apart: 2-core VMs of
# three AMD generations all call themselves "AMD EPYC", and their figures differ by 4x.
AMD_GENERATIONS = {  # family: ((first model, last model, name), ...)
    23: ((0x00, 0x2F, "zen"), (0x30, 0xFF, "zen2")),
    25: ((0x00, 0x0F, "zen3"), (0x10, 0x1F, "zen4"), (0x20, 0x5F, "zen3"), (0x60, 0xAF, "zen4")),
    26: ((0x00, 0xFF, "zen5"),),
}
INTEL_GENERATIONS = {  # family 6 models of Xeon server parts
    106: "ice-lake",
    143: "sapphire-rapids",
    173: "granite-rapids",
    207: "emerald-rapids",
}


def cpu_generation() -> str | None:
    """The CPU's generation from /proc/cpuinfo's family and model numbers (zen4, emerald-rapids,
    else f<family>m<model>); None where /proc/cpuinfo does not give them."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip():
                    break
    except OSError:
        return None
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return None
    if fields.get("vendor_id") == "AuthenticAMD":
        for first, last, name in AMD_GENERATIONS.get(family, ()):
            if first <= model <= last:
                return name
    elif fields.get("vendor_id") == "GenuineIntel" and family == 6 and model in INTEL_GENERATIONS:
        return INTEL_GENERATIONS[model]
    return f"f{family}m{model}"


def gpu_model() -> str | None:
    """The first NVIDIA GPU's name as nvidia-smi gives it, with the count when there are more
    (e.g. "NVIDIA H200", "8x NVIDIA H200"); None without nvidia-smi or a GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    if done.returncode or not names:
        return None
    return names[0] if len(names) == 1 else f"{len(names)}x {names[0]}"


def machine_kind() -> str:
    """This machine's kind as a folder name: its GPU where it has one (nvidia-h200-16c), else its
    CPU model (with the generation where the model name gives no number: amd-epyc-zen4-2c), and
    the cores this process may use. It names the machine, not the device a run used."""
    gpu = gpu_model()
    if gpu:
        slug = "-".join(re.findall(r"[a-z0-9]+", gpu.lower()))
    else:
        name = cpu_model()
        words = re.sub(r"\((r|tm)\)|\bcpu\b|\bprocessor\b|@.*$|\d+-core", " ", name.lower())
        slug = "-".join(re.findall(r"[a-z0-9]+", words)) or "unknown"
        generation = cpu_generation() if not re.search(r"\d", slug) else None
        if generation:
            slug = f"{slug}-{generation}"
    return f"{slug}-{usable_cores()}c"


def default_out(bench: str, label: str = "") -> Path:
    """bench/results/<bench>/<machine kind>/<today>[-<label>].json."""
    name = datetime.date.today().isoformat() + (f"-{label}" if label else "")
    return RESULTS_DIR / bench / machine_kind() / f"{name}.json"


def git_commit() -> str | None:
    """The checkout's commit, with `+dirty` when tracked files differ from it; None outside
    a git checkout."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        if done.returncode:
            raise OSError(done.stderr)
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def command_line() -> str:
    """How this run was started: `python -m bench.<name> ARGS` for a bench run as a module."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return shlex.join(["python", "-m", spec.name, *sys.argv[1:]])
    return shlex.join(["python", *sys.argv])


def loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


# -- the result file ----------------------------------------------------------------------------


@dataclass
class Run:
    """When a benchmark started, on what machine and under what load: the head of its JSON."""

    started: datetime.datetime
    machine: dict
    loadavg_start: list[float] | None

    @classmethod
    def begin(cls, machine: dict) -> Run:
        return cls(datetime.datetime.now().astimezone(), machine, loadavg())

    def write(self, path: Path, **body) -> None:
        """Write the JSON result: date, commit, command line, wall time, machine, load averages,
        then `body`."""
        report = {
            "date": self.started.isoformat(timespec="seconds"),
            "commit": git_commit(),
            "command": command_line(),
            "wall_s": (datetime.datetime.now().astimezone() - self.started).total_seconds(),
            "machine": self.machine,
            "loadavg_start": self.loadavg_start,
            "loadavg_end": loadavg(),
            **body,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {path}")
