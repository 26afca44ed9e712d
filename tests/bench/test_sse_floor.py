"""bench/sse_floor.py end to end: both stand-in servers in processes of their own, measured by
bench/serve.py, and a live server (here, one of the stand-ins again) in the same table."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def floor(load_bench):
    return load_bench("sse_floor")


def test_both_stand_ins_and_a_live_server(floor, tmp_path, capsys):
    live, url = floor.start("bare", 5.0)  # stands in for a running server of the user's
    try:
        out = tmp_path / "floor.json"
        argv = ["--concurrency=3", "--duration=2", "--output-len=6", "--step-ms=5",
                f"--live={url}", f"--live-pid={live.pid}", f"--out={out}"]  # fmt: skip
        assert floor.main(argv) == 0
    finally:
        live.terminate()
        live.wait(timeout=30)
    report = json.loads(out.read_text())
    assert report["workload"]["concurrency"] == 3 and report["workload"]["step_ms"] == 5.0
    rows = report["results"]
    assert set(rows) == {"bare", "app", "live"}
    for name, fig in rows.items():
        assert fig["errors"] == 0, (name, fig["error_samples"])
        assert fig["completed"] >= 3 and fig["output_tokens"] == 6 * fig["completed"]
        assert fig["usage_reported"] == fig["completed"]  # both send the usage at the end
        assert fig["server_cpu_us_per_token"] > 0 and fig["client_cpu_us_per_token"] > 0
        assert fig["itl_p50_ms"] >= 4.0  # paced by the stand-in engine's 5 ms step
    table = capsys.readouterr().out
    assert "server us/token" in table and all(f"\n{name} " in table for name in rows)


def test_arguments(floor):
    assert floor.parse_args([]).modes == ["bare", "app"]
    for bad in (["--modes=bare,engine"], ["--live=http://127.0.0.1:1/v1"], ["--live-pid=1"],
                ["--concurrency=0"], ["--step-ms=0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            floor.parse_args(bad)
