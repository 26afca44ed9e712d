"""Processes by a variable in their environment, for tests that must leave none behind (not a
test module): a process's environment at its start is inherited by what it starts, so a variable
set before a command runs marks every process of it, Ray's daemons and workers included."""

from __future__ import annotations

import os


def carrying(assignment: str) -> dict[int, str]:
    """pid -> command line of the live processes whose environment holds `assignment`
    ("NAME=value"): zombies aside, and this process's own multiprocessing resource tracker,
    which lives as long as this process."""
    needle = assignment.encode()
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        if int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        state, parent = fields[0], int(fields[1])
        own_tracker = parent == os.getpid() and "multiprocessing.resource_tracker" in command
        if state != b"Z" and not own_tracker:
            found[int(entry)] = command
    return found


# Set per pytest process by tests/conftest.py before any test runs: every process a test starts
# (Ray's daemons and workers, servers, engine processes) inherits it.
TEST_RUN_ENV = "SERVE_APP_TEST_RUN"


def started_by_this_run() -> dict[int, str]:
    """pid -> command line of the live processes that this pytest process's tests started (not
    another xdist worker's)."""
    return carrying(f"{TEST_RUN_ENV}={os.environ[TEST_RUN_ENV]}")
