"""Where `make serve`'s start-up goes: `python -m serve_app CONFIG` started as a user starts it.

    .venv/bin/python -m bench.startup                        # deployments.yaml, 3 runs
    .venv/bin/python -m bench.startup --config deployments-pd.yaml --runs 1

Each run starts the server on a copy of the config with a free port, reads its output line by
line with the time each line arrived, and takes the start-up apart at the lines that mark its
steps: Ray and Serve up (Ray's "Started Serve"), the app deployed (Serve's "Adding ... replica"
for each deployment), each replica's process up (its first line: the model or embedding
replica's "loading"), its model loaded (its "ready" line), and the server's own ready line
(printed once /v2/health/ready answers 200). Then Ctrl-C, and how long until every process of
the server is gone. The table is each step's median over the runs; the JSON has every run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import command_line, default_out, git_commit, log, machine_info
from bench.server_process import start_server, stop_server, tail

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# (step, pattern, the step it follows): the first line matching the pattern marks the step's end;
# the model and embedding replicas start side by side once the app is deployed
MARKS = (
    ("ray and serve up", re.compile(r"Started Serve in namespace"), None),
    ("app deployed", re.compile(r"Adding \d+ replicas? to Deployment"), "ray and serve up"),
    ("model replica process up", re.compile(r"model replica \S+ \(\w+\): loading"),
     "app deployed"),
    ("model loaded", re.compile(r"model replica \S+: '.*' ready on"), "model replica process up"),
    ("embedding replica process up", re.compile(r"embedding replica \S+: loading"),
     "app deployed"),
    ("embedding model loaded", re.compile(r"embedding replica \S+: '.*' ready"),
     "embedding replica process up"),
    ("server ready", re.compile(r"serve_app ready at"), "model loaded"),
)  # fmt: skip
READY_TIMEOUT_S = 600.0


def one_run(spec: dict, folder: Path) -> dict[str, float]:
    """The seconds from the command's start to each mark, and to every process gone after
    Ctrl-C ("stopped")."""
    log_path = folder / "server.log"
    started = time.monotonic()
    process, _ = start_server(spec, log_path)
    seen: dict[str, float] = {}
    offset = 0
    deadline = started + READY_TIMEOUT_S
    try:
        while "server ready" not in seen:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no ready line; the end of its output:\n{tail(log_path)}")
            text = log_path.read_text(errors="replace")
            now = time.monotonic() - started
            for line in text[offset:].splitlines(keepends=True):
                if not line.endswith("\n"):
                    break  # a line still being written: read again next time
                offset += len(line)
                line = ANSI.sub("", line)
                for step, pattern, _ in MARKS:
                    if step not in seen and pattern.search(line):
                        seen[step] = now
            time.sleep(0.05)
    finally:
        ready = time.monotonic()
        stop_server(process)
    seen["stopped after ready"] = time.monotonic() - ready
    return seen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deployments.yaml", help="a Serve config file")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="the JSON result's path")
    args = parser.parse_args(argv)
    spec = yaml.safe_load((ROOT / args.config).read_text())
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="startup-") as folder:
            runs.append(one_run(spec, Path(folder)))
        log(f"run {i + 1}: ready after {runs[-1]['server ready']:.1f} s")
    steps = [(step, after) for step, _, after in MARKS if all(step in run for run in runs)]
    medians = {step: statistics.median(run[step] for run in runs) for step, _ in steps}
    stopped = statistics.median(run["stopped after ready"] for run in runs)
    print(f"\n{'step':30} {'done at (s)':>11} {'took (s)':>9}  after")
    for step, after in steps:
        took = medians[step] - medians.get(after, 0.0)
        print(f"{step:30} {medians[step]:11.1f} {took:9.1f}  {after or 'the command started'}")
    print(f"{'stopped (after Ctrl-C)':30} {'':11} {stopped:9.1f}  the ready line")
    out = args.out or default_out("startup")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": git_commit(),
        "command": command_line(),
        "machine": machine_info(("ray", "torch", "transformers")),
        "config": args.config,
        "runs": runs,
        "median": {**medians, "stopped after ready": stopped},
    }
    out.write_text(json.dumps(result, indent=1))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
