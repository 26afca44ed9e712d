"""The bench package's modules for these tests."""

from __future__ import annotations

import importlib

import pytest


def _load(name: str):
    """bench.NAME (bench/NAME.py)."""
    return importlib.import_module(f"bench.{name}")


@pytest.fixture(scope="session")
def load_bench():
    return _load
