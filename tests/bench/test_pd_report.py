"""bench/pd.py's report from a result's figures (no server)."""

from __future__ import annotations

import pytest

from bench.pd_report import ITL_P99_TARGET, print_report, ratios


def mode(itl_p99: float, tokens_per_s: float) -> dict:
    short = {"ttft_p50_ms": 100.0, "itl_p99_ms": itl_p99, "tokens_per_s": tokens_per_s,
             "requests": 10, "itl_samples": 90,
             "ttft_split": {"behind_a_long_prompt": {"p50_ms": 300.0, "requests": 4}}}  # fmt: skip
    return {"short": short, "long": {"requests": 2, "ttft_ms": [900.0]}, "errors": 0,
            "loadavg_start": [0.1], "loadavg_end": [1.5]}  # fmt: skip


def test_ratios_favour_pd_above_one_and_name_the_target(capsys):
    results = {"colocated": mode(itl_p99=300.0, tokens_per_s=50.0), "pd": mode(100.0, 60.0)}
    rat = ratios(results)
    assert rat["itl_p99_ms"] == pytest.approx(3.0)  # colocated / PD for a latency
    assert rat["tokens_per_s"] == pytest.approx(1.2)  # PD / colocated for a throughput
    assert rat["itl_p99_target"] == ITL_P99_TARGET and rat["itl_p99_met"]
    print_report(results, rat)
    out = capsys.readouterr().out
    assert "3.00x" in out and "met" in out and "behind a long prompt: p50 300 ms over 4" in out
    assert ratios({"pd": results["pd"]}) == {}  # nothing to compare with
