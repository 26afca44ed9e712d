"""The bench/ scripts as modules for these tests (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(script: str):
    """bench/SCRIPT.py, imported once as the module `bench_SCRIPT`."""
    name = f"bench_{script}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def load_bench():
    return _load
