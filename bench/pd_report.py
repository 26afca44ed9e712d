"""bench/pd.py's report: the colocated and PD runs side by side, their ratios, how many
requests each mode served, and what the KV hand-off cost."""

from __future__ import annotations

# (figure key, label) of the short chats, compared colocated against PD
FIGURES = [
    ("ttft_p50_ms", "TTFT p50 (ms)"),
    ("ttft_p99_ms", "TTFT p99 (ms)"),
    ("itl_p50_ms", "inter-token p50 (ms)"),
    ("itl_p99_ms", "inter-token p99 (ms)"),
    ("itl_max_ms", "inter-token max (ms)"),
    ("tokens_per_s", "short-chat tokens/s"),
    ("requests_per_s", "short-chat requests/s"),
]
ITL_P99_TARGET = 2.0  # colocated p99 inter-token latency / PD's


def ratios(results: dict) -> dict:
    if not {"colocated", "pd"} <= set(results):
        return {}
    co, pd = results["colocated"]["short"], results["pd"]["short"]
    out = {}
    for key, _label in FIGURES:
        if co.get(key) and pd.get(key):
            # latencies: colocated / PD (above 1 = PD faster); throughput: PD / colocated
            higher_is_better = key.endswith("per_s")
            out[key] = pd[key] / co[key] if higher_is_better else co[key] / pd[key]
    itl = out.get("itl_p99_ms")
    out["itl_p99_target"] = ITL_P99_TARGET
    out["itl_p99_met"] = None if itl is None else itl >= ITL_P99_TARGET
    return out


def print_table(results: dict, rat: dict, modes: list[str]) -> None:
    """The short-request figures of each mode side by side, with their ratio and the target."""
    print(f"\n{'short chats':<26}" + "".join(f"{m:>12}" for m in modes) + f"{'ratio':>10}")
    for key, label in FIGURES:
        row = f"{label:<26}"
        for m in modes:
            value = results[m]["short"].get(key)
            row += f"{value:>12.1f}" if value is not None else f"{'-':>12}"
        if key in rat:
            row += f"{rat[key]:>9.2f}x"
        print(row)
    print("  ratio: colocated/PD for latencies (above 1 = PD better), PD/colocated for throughput")
    if "itl_p99_ms" in rat:
        met = "met" if rat["itl_p99_met"] else "NOT met"
        print(f"  target: PD cuts p99 inter-token latency >= {ITL_P99_TARGET:g}x: {met}")


def print_mode_counts(results: dict, modes: list[str]) -> None:
    """Per mode: request and error counts, load averages, and the TTFT split."""
    for m in modes:
        r = results[m]
        lg = r["long"]
        print(
            f"  {m}: {r['short']['requests']} short chats ({r['short']['itl_samples']} gaps), "
            f"{lg['requests']} long prompts (TTFT ms {lg['ttft_ms']}), errors {r['errors']}, "
            f"loadavg {r['loadavg_start']} -> {r['loadavg_end']}"
        )
        split = r["short"]["ttft_split"]
        parts = [
            f"{name.replace('_', ' ')}: p50 {v['p50_ms']:.0f} ms over {v['requests']}"
            for name, v in split.items()
            if v["p50_ms"] is not None
        ]
        print(f"    short TTFT, {'; '.join(parts)}")


def print_handoff(pd: dict) -> None:
    """The PD run's KV hand-off cost: under load, by TTFT stage, and for lone probes."""
    h = pd["kv_handoff"]
    per_1k = h["handoff_ms_per_1k_prompt_tokens"]
    per_tok = h["kv_bytes_per_prompt_token"]
    print(
        f"\nKV hand-off over the PD run: {h['handoffs']:.0f} hand-offs, mean "
        f"{h['handoff_mean_ms'] or float('nan'):.2f} ms, {h['kv_transfer_bytes'] / 1e6:.1f} MB "
        f"for {h['prompt_tokens_handed_off']} prompt tokens -> "
        f"{per_1k or float('nan'):.2f} ms and {(per_tok or 0) * 1e3 / 1e6:.2f} MB "
        "per 1k prompt tokens"
    )
    stages = ", ".join(
        f"{k} {v['mean_ms']:.1f}" for k, v in h["ttft_stages"].items() if v["mean_ms"]
    )
    print(f"  PD TTFT stages (mean ms over all requests): {stages}")
    p = pd["kv_handoff_probes"]
    for kind in ("short", "long"):
        if kind in p:
            g = p[kind]
            print(
                f"  alone, {g['prompt_tokens']:.0f}-token prompt: hand-off "
                f"{g['handoff_ms_median']:.2f} ms (median), {g['bytes_median'] / 1e6:.2f} MB"
            )
    if "long" in p:
        print(
            f"  -> {p['long']['handoff_ms_per_1k_tokens']:.2f} ms per 1k prompt tokens "
            f"(long prompt alone); marginal "
            f"{p.get('marginal_ms_per_1k_tokens') or float('nan'):.2f} ms per 1k tokens"
        )


def print_report(results: dict, rat: dict) -> None:
    modes = [m for m in ("colocated", "pd") if m in results]
    print_table(results, rat, modes)
    print_mode_counts(results, modes)
    pd = results.get("pd")
    if pd and "kv_handoff" in pd:
        print_handoff(pd)
