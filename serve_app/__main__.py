"""`python -m serve_app [deployments.yaml]` (what `make serve` runs): the app on Ray Serve.

Equivalent to `serve run deployments.yaml`, plus what a first-time user wants to see: the config
is checked before Ray starts (a bad key fails at once, naming it), model build and load progress
is printed as it happens, and the URL with a first request to try is printed when every model
replica is ready. Ctrl-C stops the app and the local Ray instance it started.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

from serve_app.config import ConfigError, load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="deployments.yaml", help="Serve config file")
    args = parser.parse_args()
    spec = yaml.safe_load(Path(args.config).read_text(encoding="utf-8")) or {}
    apps = spec.get("applications") or []
    if not apps:
        sys.exit(f"{args.config}: no applications")
    try:
        configs = [load_config(dict(app.get("args") or {})) for app in apps]
    except ConfigError as exc:
        sys.exit(f"{args.config}: {exc}")

    import ray
    from ray import serve

    from serve_app.app import build_app

    http = {"host": "127.0.0.1", "port": 8000, **(spec.get("http_options") or {})}
    ray.init(include_dashboard=False, logging_level="WARNING")
    serve.start(proxy_location=spec.get("proxy_location", "HeadOnly"), http_options=http)
    print("serve_app: starting (the first start builds the demo model, about a minute) ...")
    for app in apps:
        serve.run(
            build_app(app.get("args") or {}),
            name=app.get("name", "serve_app"),
            route_prefix=app.get("route_prefix", "/"),
        )
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
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nserve_app: stopping ...")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
