"""`python -m serve_app`'s choice between the ingress's own HTTP server and Ray's proxy."""

from __future__ import annotations

import os
import signal
import socket

import pytest

from serve_app import __main__ as main
from serve_app.config import load_config
from serve_app.placement import descendants, is_alive


def test_direct_ingress_gives_each_ingress_replica_a_port_from_the_configs(monkeypatch):
    for name in (
        "RAY_SERVE_ENABLE_DIRECT_INGRESS",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT",
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S",
    ):
        monkeypatch.setenv(name, "")  # so that teardown restores what was there, if anything
        monkeypatch.delenv(name)
    main._direct_ingress(8123, 2)
    assert os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "8123"
    assert os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] == "8125"  # exclusive
    # no load balancer to wait for: a stop drains ongoing requests, not Serve's 30 s
    assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2"
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "9000")
    main._direct_ingress(8123, 1)  # what the user exported wins
    assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "9000"


def test_ray_serves_background_work_is_slowed_unless_the_user_set_it(monkeypatch):
    for name in main.RAY_BACKGROUND_ENV:  # all restored at teardown: later tests start Ray
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", "100")
    monkeypatch.setenv("RAY_metrics_report_interval_ms", "10000")
    main._quiet_ray_background()
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"  # Ray's default: 0.1
    assert os.environ["RAY_event_stats"] == "0"  # Ray's core: no event loop statistics
    assert os.environ["RAY_task_events_report_interval_ms"] == "0"  # nor task events
    assert os.environ["RAY_worker_niceness"] == "0"  # replicas and engines at normal priority
    assert os.environ["REPORTER_UPDATE_INTERVAL_MS"] == "60000"  # the dashboard agent's stats
    # the agent learns of its raylet's death from a pipe, not by polling
    assert os.environ["RAY_enable_pipe_based_agent_to_parent_health_check"] == "1"
    # and the raylet waits for that agent longer than Ray's 30 s on a loaded machine
    assert os.environ["RAY_agent_register_timeout_ms"] == "120000"
    assert os.environ["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == "100"  # the user's
    assert os.environ["RAY_metrics_report_interval_ms"] == "10000"  # the user's


def test_ingress_replica_counts():
    assert main._ingress_replicas(load_config()) == 1
    three = load_config({"Deployments": {"Ingress": {"num_replicas": 3}}})
    assert main._ingress_replicas(three) == 3
    auto = load_config({"Deployments": {"Ingress": {"num_replicas": "auto"}}})
    assert main._ingress_replicas(auto) > 1  # room for autoscaled replicas
    scaled = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 5}}
    assert main._ingress_replicas(load_config({"Deployments": {"Ingress": scaled}})) == 5


def test_a_port_in_use_is_not_bindable():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert not main._bindable("127.0.0.1", port)
    assert main._bindable("127.0.0.1", main._free_port("127.0.0.1"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_as_ctrl_c_does(signum):
    # SIGTERM's default would end the process without stopping Ray (its agents left running);
    # SIGINT is ignored in a server a shell started in the background
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        main._stop_on_signals()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signum)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_ray_keeps_off_the_engines_cores_only_when_every_engine_is_bound():
    here = os.sched_getaffinity(0)
    if len(here) < 2:
        return  # nothing to leave to Ray on one core
    engine = str(max(here))

    def models(*cpus):
        items = [
            {"modelName": f"m{i}", "engineProcess": True, "engineCpus": c}
            for i, c in enumerate(cpus)
        ]
        return load_config({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": items}}})

    assert main._ray_cores([models(engine)]) == here - {max(here)}
    assert main._ray_cores([models(engine), models(engine)]) == here - {max(here)}
    assert main._ray_cores([models(engine, "")]) is None  # an unbound engine needs every core
    assert main._ray_cores([load_config()]) is None


def test_each_application_runs_with_its_name_prefix_and_logging_config():
    spec = {
        "logging_config": {"log_level": "WARNING"},
        "applications": [
            {"name": "a", "route_prefix": "/a", "logging_config": {"enable_access_log": False}},
            {"import_path": "serve_app.app:build_app"},
        ],
    }
    first, second = (main._run_options(spec, app) for app in spec["applications"])
    assert first == {
        "name": "a",
        "route_prefix": "/a",
        "logging_config": {"enable_access_log": False},  # the application's own wins
    }
    assert second == {
        "name": "serve_app",
        "route_prefix": "/",
        "logging_config": {"log_level": "WARNING"},  # else the config's top-level one
    }
    assert main._run_options({}, {})["logging_config"] is None  # Ray Serve's defaults


def test_host_overrides_the_files_http_options():
    spec = {"http_options": {"host": "127.0.0.1", "port": 9000}}
    assert main._http_options(spec) == {"host": "127.0.0.1", "port": 9000}
    assert main._http_options(spec, "0.0.0.0") == {"host": "0.0.0.0", "port": 9000}
    assert main._http_options({}) == {"host": "127.0.0.1", "port": 8000}


def test_a_ray_node_too_slow_to_register_is_started_again_with_nothing_left_of_it(monkeypatch):
    """ray.init gives its raylet 30 s to register (on a busy 2-core machine its dashboard agent
    alone took longer): the command stops what that start left running and starts Ray again."""
    import subprocess
    import sys

    import ray

    calls, started = [], []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:  # what a failed start leaves: its processes, our children
            started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            raise Exception("The current node timed out during startup. This could happen ...")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    # a child of ours from before (a test worker may have a Ray of its own): not the failed
    # start's, left alone
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        main._start_ray()
        assert ours.poll() is None
    finally:
        ours.kill()
        ours.wait()
    assert len(calls) == 2
    # killed and reaped (its pid may not be reused this soon)
    assert not is_alive(started[0].pid) and started[0].pid not in descendants()


def test_any_other_failure_of_ray_init_is_raised_at_once(monkeypatch):
    import ray

    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        raise RuntimeError("Maybe you called ray.init twice by accident?")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(RuntimeError, match="twice"):
        main._start_ray()
    assert len(calls) == 1


def test_ray_is_started_here_unless_ray_address_names_one(monkeypatch):
    """Not the cluster of the last `ray start` on this machine (Ray's default, which tries a
    cluster that may have died, leaving its address behind)."""
    import ray

    calls = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs["address"]))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    main._start_ray()
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    main._start_ray()
    assert calls == ["local", "10.0.0.5:6379"]
