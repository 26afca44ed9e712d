"""bench/overload.py's helpers that the soak and the overload bench share."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from overload import replica_rss_mb  # noqa: E402


def test_replica_memory_is_keyed_by_deployment_whatever_method_the_replica_runs(monkeypatch):
    # Ray titles a replica's process with the method it runs at the moment, if any
    titles = {
        "ray::ServeReplica:serve_app:ModelReplica.check_health": 100,
        "ray::ServeReplica:serve_app:Ingress": 50,
        "ray::ServeReplica:serve_app:Ingress.__call__": 30,
        "python -c from serve_app.engine.engine_process import _child_main; _child_main(5)": 70,
        "python -m pytest": 999,
    }
    procs = [
        SimpleNamespace(
            info={"cmdline": title.split(), "memory_info": SimpleNamespace(rss=mb << 20)}
        )
        for title, mb in titles.items()
    ]
    monkeypatch.setattr(psutil, "process_iter", lambda attrs: iter(procs))
    assert replica_rss_mb() == {"ModelReplica": 100, "Ingress": 80, "engine process": 70}
