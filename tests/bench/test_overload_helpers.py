"""bench/overload.py's helpers that the soak and the overload bench share."""

from __future__ import annotations

from types import SimpleNamespace

import psutil

from bench.overload import engine_processes, replica_rss_mb


def _fake(title: str, mb: int, parent: str | None = None) -> SimpleNamespace:
    parent_proc = SimpleNamespace(cmdline=lambda: parent.split()) if parent else None
    return SimpleNamespace(
        info={"cmdline": title.split(), "memory_info": SimpleNamespace(rss=mb << 20)},
        parent=lambda: parent_proc,
    )


ENGINE = "python -c from serve_app.engine.host.process import _child_main; _child_main(5)"


def test_replica_memory_is_keyed_by_deployment_whatever_method_the_replica_runs(monkeypatch):
    # Ray titles a replica's process with the method it runs at the moment, if any
    procs = [
        _fake("ray::ServeReplica:serve_app:ModelReplica.check_health", 100),
        _fake("ray::ServeReplica:serve_app:Ingress", 50),
        _fake("ray::ServeReplica:serve_app:Ingress.__call__", 30),
        _fake(ENGINE, 70, parent="ray::ServeReplica:serve_app:ModelReplica"),
        _fake("python -m pytest", 999),
    ]
    monkeypatch.setattr(psutil, "process_iter", lambda attrs: iter(procs))
    assert replica_rss_mb() == {"ModelReplica": 100, "Ingress": 80, "engine process": 70}


def test_only_a_replicas_engine_processes_count(monkeypatch):
    # the same command started by something else here (a test of the engine process, a bench
    # running beside the server) is not the server's
    served = _fake(ENGINE, 70, parent="ray::ServeReplica:serve_app:ModelReplica-demo")
    procs = [served, _fake(ENGINE, 40, parent="python -m pytest"), _fake(ENGINE, 10)]
    monkeypatch.setattr(psutil, "process_iter", lambda attrs: iter(procs))
    assert engine_processes() == [served]
    assert replica_rss_mb() == {"engine process": 70}
