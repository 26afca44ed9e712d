"""CPU time of a server's processes while a load level runs, from /proc (Linux).

A server on the same machine as the load generator shares its cores with it: what the server's
processes (a process and all its descendants: for ours the Ray workers, the engine process) and
the load generator itself spend per streamed token says where the machine's time goes, next to
the throughput. `TreeCPU(pids).snapshot()` before and after a level, `TreeCPU.spent(before,
after)` the seconds per process label (the command line's start: Ray names its workers there,
e.g. `ray::ServeReplica:serve_app:Ingress`).
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
LABEL_CHARS = 60


class TreeCPU:
    """The processes `roots` and their descendants, found again at every snapshot (a process
    that starts during a level counts from zero, one that ends before its close is missed)."""

    def __init__(self, roots: list[int]) -> None:
        if not self.available():
            raise RuntimeError("server CPU needs /proc (Linux)")
        self.roots = list(roots)
        self.tick = os.sysconf("SC_CLK_TCK")

    def snapshot(self) -> dict[int, tuple[str, float]]:
        """pid -> (label, user + system CPU seconds so far) for the trees now."""
        stats = _all_stats()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        out, todo = {}, [p for p in self.roots if p in stats]
        while todo:
            pid = todo.pop()
            if pid in out:
                continue
            out[pid] = (_label(pid), stats[pid][1] / self.tick)
            todo.extend(children.get(pid, ()))
        return out

    @staticmethod
    def available() -> bool:
        """Whether this machine shows processes' CPU times (Linux /proc)."""
        return PROC.is_dir()

    @staticmethod
    def exists(pid: int) -> bool:
        return (PROC / str(pid) / "stat").exists()

    @staticmethod
    def spent(before: dict, after: dict) -> dict[str, float]:
        """CPU seconds per label between two snapshots, largest first."""
        by_label: dict[str, float] = {}
        for pid, (label, seconds) in after.items():
            used = seconds - before.get(pid, (label, 0.0))[1]
            if used > 0:
                by_label[label] = by_label.get(label, 0.0) + used
        return dict(sorted(by_label.items(), key=lambda kv: -kv[1]))


def session_processes(session: int) -> list[int]:
    """The live processes (zombies left out) of a session, by its leader's pid."""
    return [pid for pid, f in _stat_fields() if int(f[3]) == session and f[0] != "Z"]


def _all_stats() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, utime + stime in clock ticks) of every process readable now."""
    return {pid: (int(f[1]), int(f[11]) + int(f[12])) for pid, f in _stat_fields()}


def _stat_fields():
    """(pid, the fields of /proc/PID/stat after the name) of every process readable now: state,
    parent, process group, session, ..."""
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        yield int(entry.name), text[text.rfind(")") + 2 :].split()  # a name may hold parens


def _label(pid: int) -> str:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        raw = b""
    text = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    if not text:
        try:
            text = (PROC / str(pid) / "comm").read_text().strip()
        except OSError:
            text = f"pid {pid}"
    return text[:LABEL_CHARS]
