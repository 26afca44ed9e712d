"""bench/layout.py: the served CPU layout against every core, alternating in one process. Its
arguments and checks, the summary's arithmetic, and one short run on the tiny demo model (in a
process of its own: the script binds its whole process to cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.engine.backends.cpu import kernels as cpu_kernels

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lb(load_bench):
    return load_bench("layout")


def test_the_default_layout_is_the_servers_on_this_machine(lb, monkeypatch):
    monkeypatch.setattr(lb, "available_cores", lambda: {0, 1, 2, 3})
    args = lb.parse_args([])
    assert (args.engine, args.spare) == ((3,), (0, 1, 2))  # the last core, helpers on the rest
    assert (args.model, args.dtype, args.rounds) == ("demo", "bfloat16", 4)
    args = lb.parse_args(["--engine-cpus", "2-3", "--spare-cpus", "0,1"])
    assert (args.engine, args.spare) == ((2, 3), (0, 1))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--output-len", "0"], "--output-len must be >= 1"),
        (["--engine-cpus", "1-0"], "not a range of core ids"),
    ],
)
def test_bad_arguments_are_named(lb, capsys, argv, message):
    with pytest.raises(SystemExit):
        lb.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(cpu_kernels.op("use_spare_cpus") is None, reason="no CPU kernels here")
@pytest.mark.parametrize(
    "engine, spare, message",
    [
        ((1,), (1,), "two disjoint core lists"),
        ((1,), (), "two disjoint core lists"),
        ((4096,), (0,), "cores 4096 are not available here"),
    ],
)
def test_cores_the_layout_cannot_have_are_refused(lb, engine, spare, message):
    with pytest.raises(SystemExit, match=message):
        lb.check_cores(engine, spare)


def test_the_summary_is_the_median_of_the_rounds_and_the_served_layouts_ratio(lb):
    def run(prefill, step, rate):
        return {"prefill_ms": prefill, "decode_step_ms": step, "tokens_per_s": rate}

    rounds = {
        "served": [run(110, 12.0, 900), run(130, 11.0, 1000), run(120, 13.0, 950)],
        "all_cores": [run(100, 10.0, 1000), run(100, 10.0, 1000), run(100, 10.0, 1000)],
    }
    summary = lb.summarize(rounds)
    assert summary["medians"]["served"] == run(120, 12.0, 950)
    ratios = summary["served_over_all_cores"]
    assert ratios == pytest.approx({"prefill_ms": 1.2, "decode_step_ms": 1.2, "tokens_per_s": 0.95})
    assert "engine_process_over_all_cores" not in summary


def test_the_engine_process_arm_is_compared_round_by_round(lb):
    def run(rate, step=10.0):
        return {"prefill_ms": 100, "decode_step_ms": step, "tokens_per_s": rate}

    process = {"prefill_ms": None, "decode_step_ms": None}
    rounds = {
        "served": [run(900), run(1000)],
        "all_cores": [run(1000), run(1200)],
        "engine_process": [{**process, "tokens_per_s": 900}, {**process, "tokens_per_s": 1200}],
    }
    summary = lb.summarize(rounds)
    # each round's own ratio (0.9, then 1.0), not the ratio of the medians
    assert summary["engine_process_over_all_cores"] == pytest.approx(0.95)
    assert summary["medians"]["engine_process"] == {"tokens_per_s": 1050}


@pytest.mark.skipif(
    cpu_kernels.op("use_spare_cpus") is None or len(os.sched_getaffinity(0)) < 2,
    reason="needs the engine's CPU kernels and two cores",
)
def test_a_short_run_measures_both_layouts_and_the_engine_process(tmp_path):
    out = tmp_path / "layout.json"
    workload = "--model demo-tiny --dtype float32 --requests 4 --prompt-len 16 --output-len 6"
    argv = [*workload.split(), "--block-size", "16", "--rounds", "2", "--out", str(out)]
    argv += ["--engine-process", "--process-requests", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "bench.layout", *argv], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "served / all cores" in done.stdout
    report = json.loads(out.read_text())
    # where it came from: the commit, the command line, the machine, the date
    assert report["command"].startswith("python -m bench.layout --model demo-tiny")
    assert report["commit"] and report["machine"]["cpu_model"] and report["date"]
    assert report["workload"]["rounds"] == 2 and report["workload"]["model"] == "demo-tiny"
    for layout in ("served", "all_cores"):
        runs = report["rounds"][layout]
        assert len(runs) == 2
        assert all(r["tokens_per_s"] > 0 and r["decode_step_ms"] > 0 for r in runs)
    assert set(report["served_over_all_cores"]) == {"prefill_ms", "decode_step_ms", "tokens_per_s"}
    chunks = report["served_chunks_per_round"]
    assert chunks["step_loop"] > 0  # the served layout's GEMMs were shared chunk by chunk
    # the engine process's arm: every request of every round came back whole
    process = report["rounds"]["engine_process"]
    assert len(process) == 2 and all(r["tokens_per_s"] > 0 for r in process)
    assert all(r["completed"] == r["requests"] == 4 * 2 for r in process)
    assert report["engine_process_over_all_cores"] > 0
    assert "engine process / all cores" in done.stdout


def test_a_result_goes_under_its_bench_and_machine_kind_by_date():
    from bench.common import RESULTS_DIR, default_out, machine_kind

    kind = machine_kind()
    assert kind.endswith("c") and "/" not in kind and " " not in kind
    path = default_out("engine", "quick")
    assert path.parent == RESULTS_DIR / "engine" / kind
    assert path.name.endswith("-quick.json") and path.name[:4].isdigit()
