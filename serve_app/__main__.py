"""`python -m serve_app [deployments.yaml]` (what `make serve` runs): the app on Ray Serve.

Equivalent to `serve run deployments.yaml`, plus what a first-time user wants to see: the config
is checked before Ray starts (a bad key fails at once, naming it), model build and load progress
is printed as it happens, and the URL with a first request to try is printed when every model
replica is ready. Where every model's engine process is bound to cores of its own (engineCpus),
the Ray instance it starts keeps to the other cores once the app is up (while it starts, Ray and
the replicas load on every core: bound from the start, on 2 cores the engine's core sat idle
while everything else loaded on the other, a start-up of ~37 s instead of ~25). Ctrl-C or
SIGTERM (`kill`, a service
manager's stop) stops the app and the local Ray instance it started, with every process Ray
started for it.

By default the ingress replica serves HTTP itself on the config's http_options port (Ray Serve's
direct ingress: no proxy actor between the client and the app, one process hop less per streamed
chunk; Ray's proxy is moved to a free port); `--proxy` keeps Ray Serve's HTTP proxy in front on
that port, as `serve run` does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

import yaml

from serve_app.config import ConfigError, load_config
from serve_app.deployment_options import METRICS_INTERVAL, SERVE_FAST_PATH_ENV
from serve_app.placement import (
    bind_descendants,
    bind_process,
    descendants,
    is_alive,
    resolve_cpus,
    serving_cores,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="deployments.yaml", help="Serve config file")
    parser.add_argument(
        "--host",
        help="the address to serve HTTP on, over the config's http_options.host (0.0.0.0: every "
        "interface, as in a container)",
    )
    parser.add_argument(
        "--proxy",
        action="store_true",
        help="serve HTTP through Ray Serve's proxy actor (as `serve run` does) instead of "
        "from the ingress replica itself",
    )
    args = parser.parse_args()
    spec = yaml.safe_load(Path(args.config).read_text(encoding="utf-8")) or {}
    apps = spec.get("applications") or []
    if not apps:
        sys.exit(f"{args.config}: no applications")
    try:
        # (the app builder loads each again, and says then what has no effect)
        configs = [load_config(dict(app.get("args") or {}), warn=False) for app in apps]
    except ConfigError as exc:
        sys.exit(f"{args.config}: {exc}")

    import ray
    from ray import serve

    from serve_app.app import build_app

    http = _http_options(spec, args.host)
    proxy_http = http
    if not args.proxy and not _bindable(http["host"], http["port"]):
        # Ray binds the ingress's own server without SO_REUSEADDR, which fails while the port
        # still has connections in TIME_WAIT (a server stopped less than a minute ago)
        print(
            f"serve_app: port {http['port']} is not free for the ingress replica yet "
            "(connections of an earlier server linger for up to a minute): serving through "
            "Ray Serve's proxy instead",
            flush=True,
        )
        args.proxy = True
    if not args.proxy:
        _direct_ingress(http["port"], sum(_ingress_replicas(c) for c in configs))
        # Ray Serve still starts its proxy; it moves to a free port out of the way
        proxy_http = {**http, "port": _free_port(http["host"])}
    _quiet_ray_background()
    _start_ray()
    serve.start(proxy_location=spec.get("proxy_location", "HeadOnly"), http_options=proxy_http)
    print("serve_app: starting (a built-in model is built into the cache on its first use) ...")
    for app in apps:
        serve.run(build_app(app.get("args") or {}), **_run_options(spec, app))
    if cores := _ray_cores(configs):
        # Ray's processes, and the workers it starts from now on, off the engines' cores (the
        # replicas and the engine processes bound themselves as they started)
        bind_descendants(cores)
        bind_process(cores)
    try:
        _stop_on_signals()  # before it says it is ready: a signal from then on stops it
        url = f"http://{http['host']}:{http['port']}"
        model = configs[0].BackendConfig.ModelDeployConfig.ModelConfig[0].modelName
        print(
            f"\nserve_app ready at {url}  (docs: {url}/docs, metrics: {url}/metrics)\n"
            f"try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], '
            f'"max_tokens": 16}}\'\n'
            "Ctrl-C stops it.",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nserve_app: stopping ...")
    finally:
        serve.shutdown()
        ray.shutdown()


# What ray.init raises when its raylet did not register within the 30 s Ray allows it (fixed in
# Ray's code): the raylet waits for its dashboard agent, whose imports alone can take that long
# on a busy 2-core machine.
RAY_SLOW_START = "timed out during startup"


def _start_ray(tries: int = 2) -> None:
    """Ray for this command: an instance of its own (or RAY_ADDRESS's cluster), started again
    (once by default) when its node was too slow to register, after stopping what the failed
    start left running (its GCS, raylet and agents are this process's children, which
    ray.shutdown does not know of)."""
    import ray

    for attempt in range(1, tries + 1):
        before = set(descendants())
        try:
            # a Ray instance of its own (not the last `ray start`'s, which Ray would join, and
            # which may be long gone), unless the user names one in RAY_ADDRESS
            address = os.environ.get("RAY_ADDRESS") or "local"
            ray.init(address=address, include_dashboard=False, logging_level="WARNING")
            return
        except Exception as exc:
            if RAY_SLOW_START not in str(exc) or attempt == tries:
                raise
        print(
            "serve_app: Ray's node did not register within 30 s (a busy machine): "
            "starting Ray again",
            flush=True,
        )
        ray.shutdown()
        _kill([pid for pid in descendants() if pid not in before])


def _kill(pids: list[int], wait_s: float = 10) -> None:
    """SIGKILL to these processes; waits (reaping those that are our children) until they are
    gone."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while pids and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ChildProcessError):  # not our child: init reaps it
                os.waitpid(pid, os.WNOHANG)
        pids = [pid for pid in pids if is_alive(pid)]
        time.sleep(0.05)


def _run_options(spec: dict, app: dict) -> dict:
    """serve.run's options for one application of the Serve config, as `serve run` reads them:
    its name, route prefix and `logging_config` (the application's own, else the config's
    top-level one; e.g. `{enable_access_log: false}` drops the log line Ray Serve writes per
    request in every deployment)."""
    return {
        "name": app.get("name", "serve_app"),
        "route_prefix": app.get("route_prefix", "/"),
        "logging_config": app.get("logging_config") or spec.get("logging_config"),
    }


def _ray_cores(configs) -> set[int] | None:
    """The cores for the Ray instance this command starts (GCS, raylet, Serve's controller and
    proxy, the workers: all inherit them) when every model's engine process is bound to cores of
    its own: the rest, where they do not take turns with a step loop. None (no binding) when
    some engine is not bound: its replica must keep every core."""
    models = [m for c in configs for m in c.BackendConfig.ModelDeployConfig.ModelConfig]
    if not all(m.engineProcess and resolve_cpus(m.engineCpus) for m in models):
        return None
    bound = {c for m in models for c in resolve_cpus(m.engineCpus)}
    return serving_cores(bound)


def _stop_on_signals() -> None:
    """SIGTERM stops the app as Ctrl-C does (its default action would end this process at once,
    leaving Ray's agents behind), and so does SIGINT where a shell that started us in the
    background set it to be ignored."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _ingress_replicas(config) -> int:
    """How many ingress replicas may run at once (each needs a port of its own)."""
    ingress = config.Deployments.Ingress
    if ingress.num_replicas == "auto" or ingress.autoscaling_config:
        return int((ingress.autoscaling_config or {}).get("max_replicas", 8))
    return ingress.num_replicas or 1


def _bindable(host: str, port: int) -> bool:
    """Whether a socket without SO_REUSEADDR can bind (host, port) now, as Ray's will."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Ray's background work, for the Ray instance started here (its processes read these from the
# environment; what the user exported wins): Serve's controller reconciles every 0.5 s instead of
# 0.1 s (a dead replica is noticed up to 0.4 s later); replicas and handles export their request
# metrics once a second; Ray's core keeps no timing statistics of its event loops and no task
# events (debug output and the dashboard's task list, which this command does not start),
# exports its own system metrics every 60 s (the server's /metrics is the app's own), reports
# node resources every second (scheduling and the autoscaler see a node's load up to a second
# later); the log monitor looks for new log files every 0.5 s; the dashboard agent collects
# process statistics once a minute and learns of its raylet's death from a pipe. On a small
# node all of this otherwise takes a share of the core the serving path shares with the engine's
# helpers. Ray's workers (every replica, and so the engine process) start at niceness 0, as
# Ray's job drivers do, not Ray's default 15: at 15 the engine's core looked idle to the
# kernel's load balancing, which placed other processes there to preempt the step loop. The
# measurements behind each: docs/performance.md, "Ray's background settings". And the raylet
# waits 120 s, not 30, for its dashboard agent to start: on a loaded 2-core machine the agent's
# imports alone took longer, and the raylet then died ("the current node timed out during
# startup").
RAY_BACKGROUND_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # the deployments have it in their runtime_env; here for Ray's proxy (its router) too
    METRICS_INTERVAL: SERVE_FAST_PATH_ENV[METRICS_INTERVAL],
    "RAY_event_stats": "0",
    "RAY_task_events_report_interval_ms": "0",
    "RAY_metrics_report_interval_ms": "60000",
    "RAY_raylet_report_resources_period_milliseconds": "1000",
    "RAY_gcs_pull_resource_loads_period_milliseconds": "5000",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
    "RAY_enable_pipe_based_agent_to_parent_health_check": "1",
    "RAY_agent_register_timeout_ms": "120000",
}


def _quiet_ray_background() -> None:
    for name, value in RAY_BACKGROUND_ENV.items():
        os.environ.setdefault(name, value)


def _http_options(spec: dict, host: str | None = None) -> dict:
    """Where to serve HTTP: the file's http_options over 127.0.0.1:8000, `host` (--host) over
    both."""
    http = {"host": "127.0.0.1", "port": 8000, **(spec.get("http_options") or {})}
    return {**http, "host": host} if host else http


def _direct_ingress(port: int, num_ingress: int) -> None:
    """Ray Serve's direct ingress for the Ray instance about to start here (it reads these
    from the environment): each ingress replica listens on a port from `port` on."""
    os.environ.setdefault("RAY_SERVE_ENABLE_DIRECT_INGRESS", "1")
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", str(port))
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", str(port + num_ingress))
    # Serve keeps a stopping ingress replica listening for at least this long, so that a load
    # balancer in front of it can take it out of rotation (default 30 s). Here no balancer sits
    # in front of the ports, and with 30 s every Ctrl-C waited 30 s; ongoing requests are still
    # waited for, up to the deployment's graceful_shutdown_timeout_s.
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")


if __name__ == "__main__":
    main()
