"""What every benchmark records about the machine it ran on, so runs can be compared."""

from __future__ import annotations

import os
import platform
from importlib import metadata


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(packages: tuple[str, ...] = ("torch", "transformers")) -> dict:
    """CPU, usable cores, the given packages' versions, Python and the platform."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    versions = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        **versions,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None
