"""Engine throughput benchmark: our engine against transformers' own ways of generating.

    .venv/bin/python -m bench.engine              # 32 x 128-token prompts x 128 tokens, fp32+bf16
    .venv/bin/python -m bench.engine --quick      # 8 x 32 x 16 smoke test (under ~2 minutes)
    .venv/bin/python -m bench.engine --dtype float32 --repeats 3
    .venv/bin/python -m bench.engine --model smollm2-135m-instruct   # the real built-in model
    .venv/bin/python -m bench.engine --world-size 2   # tensor parallelism: ranks 1 vs 2

Every system generates the same greedy, EOS-free workload on the demo model (or --model), after
a short warm-up, and is scored as output tokens / wall seconds. See bench/README.md for what each
system is and how to read the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import transformers
from transformers.generation import ContinuousBatchingConfig

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

from bench.common import (  # noqa: E402  (bench/common.py, next to this script)
    Run,
    default_out,
    log,
    machine_info,
    percentile,
    prompt_vocab,
    seeded_prompts,
)
from bench.hf_systems import (  # noqa: E402
    cb_config,
    cb_page_size,
    run_bare_loop,
    run_hf_cb,
    run_hf_one_at_a_time,
    run_hf_static,
)
from bench.peers import PeerUnavailable, vllm_python  # noqa: E402
from bench.roofline import (  # noqa: E402
    memory_roofline,
    print_memory_roofline,
    roofline,
    sync,
    transformers_too_slow,
)
from serve_app.engine import LLM, EngineRequest, SamplingParams  # noqa: E402
from serve_app.models.loader import load_model, resolve_model_path  # noqa: E402

WARMUP_TOKENS = 4  # output tokens of every warm-up run
WARMUP_SEED_OFFSET = 1_000_000  # the warm-up's prompts come from seed + this

# (system key, label, target ratio ours/system or None, target text)
SYSTEMS = [
    ("ours", "ours (serve_app LLM)", None, ""),
    ("hf_cb", "transformers generate_batch (CB)", 2.0, ">= 2x"),
    ("hf_static", "transformers generate, static batch", 1.0, ">= 1x"),
    ("hf_one_at_a_time", "transformers generate, one at a time", None, "(info)"),
    ("bare_loop", "bare forward loop (DynamicCache)", 0.95, ">= ~1.0x"),
    ("vllm", "vLLM-CPU LLM.generate (--peers vllm)", 1.1, ">= 1.1x"),
]


# -- helpers ------------------------------------------------------------------------------------


def timed_runs(fn: Callable[[list[list[int]]], list[list[int]]], prompt_sets, device):
    """Time fn on each prompt set; returns (per-run seconds, the last run's token lists).

    Each repeat gets prompts of its own, so that no prefix cache (ours, or transformers CB's
    block sharing in its persistent manager) can reuse an earlier repeat's KV blocks.
    """
    seconds, tokens = [], []
    for prompts in prompt_sets:
        sync(device)
        start = time.perf_counter()
        tokens = fn(prompts)
        sync(device)
        seconds.append(time.perf_counter() - start)
    return seconds, tokens


def summarize(seconds: list[float], num_tokens: int, note: str = "") -> dict:
    median = statistics.median(seconds)
    result = {
        "output_tokens": num_tokens,
        "seconds": median,
        "tokens_per_s": num_tokens / median,
        "runs_s": seconds,
    }
    if note:
        result["note"] = note
    return result


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How many requests produced exactly the reference's tokens (compared over other's rows)."""
    same = [a == b for a, b in zip(reference, other, strict=False)]
    return {"identical": sum(same), "compared": len(same), "first_two": same[:2]}


# -- the systems --------------------------------------------------------------------------------


def kv_blocks(args) -> int:
    """KV blocks for `args.requests` sequences of the workload, twice over (room for the
    warm-up's cached prefixes too)."""
    per_seq = -(-(args.prompt_len + args.output_len) // args.block_size) + 1
    return 2 * args.requests * per_seq


def build_ours(args, dtype: str) -> LLM:
    return LLM(
        model=args.model,
        dtype=dtype,
        max_batch_size=args.requests,
        max_prefill_batch_size=args.requests,
        max_prefill_tokens=args.prefill_tokens,
        max_input_token_len=args.prompt_len,
        max_seq_len=args.prompt_len + args.output_len,
        max_iter_times=args.output_len,
        block_size=args.block_size,
        num_kv_blocks=kv_blocks(args),
        enforce_eager=args.enforce_eager,
    )


def run_ours(llm: LLM, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def ours_steps(llm: LLM, prompts: list[list[int]], output_len: int) -> list[float]:
    """Seconds of every engine.step() while the prompts run together, alone (greedy, EOS
    ignored), the first (the prefill, when the prompts fit one step's budget, as the bench
    sizes it) included. A step returns its tokens to the host, so on an accelerator its time
    includes the device's."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine, step_seconds = llm.engine, []
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"steps-{i}-{time.monotonic_ns()}", prompt, params))
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        step_seconds.append(time.perf_counter() - start)
    return step_seconds


def ours_decode_steps(llm: LLM, batches: list[list[list[int]]], output_len: int) -> list[float]:
    """Seconds of every engine.step() after the first (`ours_steps`) while each batch of
    prompts runs together, alone."""
    return [s for batch in batches for s in ours_steps(llm, batch, output_len)[1:]]


def ours_token_gaps(llm: LLM, prompts: list[list[int]], output_len: int) -> list[float]:
    """Batch-1 decode latency: each request alone, every engine.step() after the first timed."""
    return ours_decode_steps(llm, [[prompt] for prompt in prompts], output_len)


# -- one dtype ----------------------------------------------------------------------------------


@dataclass
class DtypeBench:
    """One dtype's run: the workload, and every system's summary and tokens as they come."""

    args: argparse.Namespace
    dtype: str
    prompt_sets: list[list[list[int]]]  # one set per timed repeat
    warm_prompts: list[list[int]]
    device: torch.device | None = None  # where our engine runs; the HF model follows it
    systems: dict[str, dict] = field(default_factory=dict)
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # peer -> why it did not run
    gemm: dict[str, tuple[float, int]] | None = None  # gemm_rates, once measured
    batch_steps: list[float] = field(default_factory=list)  # ours, all requests decoding
    graph_sizes: list[int] | None = None  # ours on CUDA: the decode steps captured as graphs

    @property
    def prompts(self) -> list[list[int]]:
        return self.prompt_sets[0]

    @property
    def one(self) -> list[list[int]]:
        """The requests measured one at a time (batch-1 latency, one-at-a-time generate)."""
        return self.prompts[: self.args.one_at_a_time]

    def log(self, message: str) -> None:
        log(message, self.dtype)

    def record(self, key: str, name: str, seconds: list[float], tokens, note: str = "") -> None:
        self.systems[key] = summarize(seconds, sum(map(len, tokens)), note)
        self.tokens[key] = tokens
        self.log(f"{name}: {self.systems[key]['tokens_per_s']:.1f} tok/s")

    def warm_then_time(self, key: str, name: str, run) -> None:
        """A warm-up of `run` (model, prompts, output_len) on the warm-up prompts, then timed."""
        run(self.warm_prompts, WARMUP_TOKENS)
        seconds, tokens = timed_runs(
            partial(run, output_len=self.args.output_len), self.prompt_sets, self.device
        )
        self.record(key, name, seconds, tokens)


def measure_ours(bench: DtypeBench) -> tuple[dict, list[float]]:
    """Our engine: throughput, then batch-1 decode gaps. Returns its config and the gaps."""
    bench.log("loading our engine ...")
    llm = build_ours(bench.args, bench.dtype)
    bench.device = llm.engine.runner.device
    graphs = llm.engine.runner.decode_graphs
    bench.graph_sizes = graphs.sizes if graphs is not None else None
    if graphs is not None:
        bench.log(f"ours: decode steps as CUDA graphs, batch sizes {graphs.sizes}")
    config = dataclasses.asdict(llm.config)
    bench.log(f"ours: warm-up, then {len(bench.prompts)} requests on {bench.device} ...")
    bench.warm_then_time("ours", "ours", partial(run_ours, llm))

    if bench.device.type != "cpu":
        bench.log(f"ours: decode steps with all {len(bench.prompts)} requests together ...")
        bench.batch_steps = ours_decode_steps(llm, [bench.prompts], bench.args.output_len)
        median = 1e3 * statistics.median(bench.batch_steps)
        bench.log(f"ours: decode step at batch {len(bench.prompts)}: {median:.2f} ms (median)")
    bench.log(f"ours: batch-1 decode latency over {len(bench.one)} requests ...")
    ours_token_gaps(llm, bench.warm_prompts[:1], WARMUP_TOKENS)
    token_gaps = ours_token_gaps(llm, bench.one, bench.args.output_len)
    del llm
    gc.collect()
    return config, token_gaps


def measure_ours_again(bench: DtypeBench) -> None:
    """Our throughput once more, right after vLLM: the two runs of ours bracket vLLM's in time,
    and vLLM's ratio is taken against their mean, so the machine's speed drifting over the
    minutes a run takes (by 10-20 % on a shared box) moves both sides alike."""
    llm = build_ours(bench.args, bench.dtype)
    bench.log("ours again, right after vLLM ...")
    bench.warm_then_time("ours_again", "ours again", partial(run_ours, llm))
    del llm
    gc.collect()


def measure_hf_cb(bench: DtypeBench, model) -> ContinuousBatchingConfig:
    """transformers continuous batching; returns the CB config it ran with."""
    config = cb_config(bench.args)
    bench.log("transformers CB: warm-up ...")
    run_hf_cb(model, bench.warm_prompts, WARMUP_TOKENS, config)
    bench.log("transformers CB: timed ...")
    seconds, tokens = timed_runs(
        partial(run_hf_cb, model, output_len=bench.args.output_len, config=config),
        bench.prompt_sets,
        bench.device,
    )
    model.destroy_cached_continuous_batching_manager()
    note = (
        f"attn={model.config._attn_implementation}, page_size={cb_page_size(config)}, "
        f"num_blocks={config.num_blocks}, max_batch_tokens={config.max_batch_tokens}, "
        f"max_requests_per_batch={config.max_requests_per_batch}"
    )
    bench.record("hf_cb", "transformers CB", seconds, tokens, note)
    return config


def measure_hf_one_at_a_time(bench: DtypeBench, model) -> list[float]:
    """generate() on the first requests alone; tokens/s extrapolates to the whole workload.
    Returns the gaps between generated tokens its streamer saw (batch-1 decode latency)."""
    one, num = bench.one, len(bench.prompts)
    bench.log(f"one-at-a-time generate over the first {len(one)} requests ...")
    run_hf_one_at_a_time(model, bench.warm_prompts[:1], WARMUP_TOKENS)
    hf_gaps: list[float] = []
    seconds, tokens = timed_runs(
        partial(run_hf_one_at_a_time, model, output_len=bench.args.output_len, token_gaps=hf_gaps),
        [p[: bench.args.one_at_a_time] for p in bench.prompt_sets],
        bench.device,
    )
    note = ""
    if len(one) < num:
        whole = statistics.median(seconds) * num / len(one)
        note = (
            f"measured on the first {len(one)} of {num} requests; tokens/s extrapolated"
            f" (the whole workload would take ~{whole:.1f} s)"
        )
    bench.record("hf_one_at_a_time", "one at a time", seconds, tokens, note)
    return hf_gaps


def measure_hf(
    bench: DtypeBench, model_path: Path
) -> tuple[str, ContinuousBatchingConfig, list[float]]:
    """The transformers systems on a plain copy of the same weights with its default attention.
    Returns the attention implementation, the CB config and the one-at-a-time token gaps."""
    model = load_model(model_path, getattr(torch, bench.dtype), bench.device)
    attn = model.config._attn_implementation
    bench.log(f"transformers model loaded (attn_implementation={attn})")
    config = measure_hf_cb(bench, model)
    bench.log("static batch generate ...")
    bench.warm_then_time("hf_static", "static batch", partial(run_hf_static, model))
    hf_gaps = measure_hf_one_at_a_time(bench, model)
    bench.log("bare forward loop ...")
    bench.warm_then_time("bare_loop", "bare loop", partial(run_bare_loop, model))
    del model
    gc.collect()
    return attn, config, hf_gaps


def measure_vllm(bench: DtypeBench, model_path: Path) -> None:
    """vLLM's CPU build on the same weights and prompts, in its own venv (bench/peers.py) and
    process (bench/vllm_offline.py); skipped, with the reason, when it cannot run."""
    args = bench.args
    work = Path(tempfile.mkdtemp(prefix="vllm-offline-"))
    log_path = args.out.with_name(f"{args.out.stem}-vllm.log")
    job = {
        "model_dir": str(model_path),
        "dtype": bench.dtype,
        "max_model_len": args.prompt_len + args.output_len,
        "max_num_seqs": args.requests,
        "output_len": args.output_len,
        "warm_prompts": bench.warm_prompts,
        "prompt_sets": bench.prompt_sets,
        "warmup_tokens": WARMUP_TOKENS,
    }
    (work / "job.json").write_text(json.dumps(job))
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache
    # vLLM's CPU build keeps one core per process for its scheduler by default, which on a
    # 2-core machine leaves its model one thread; offline there is no server to keep a core
    # for, and our engine gets every core, so vLLM gets them too (the environment may differ).
    reserved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": space, "VLLM_CPU_NUM_OF_RESERVED_CPU": reserved}
    try:
        python = vllm_python(log_path)
        bench.log(f"vLLM-CPU: LLM.generate in {python.parent.parent} (log: {log_path}) ...")
        with log_path.open("a") as out:
            code = subprocess.call(
                [str(python), str(HERE / "vllm_offline.py"), str(work / "job.json"),
                 str(work / "result.json")],
                stdout=out, stderr=subprocess.STDOUT, env=env, timeout=args.peer_timeout,
            )  # fmt: skip
        if code != 0:
            raise PeerUnavailable(f"vllm_offline.py exited with {code}; see {log_path}")
        result = json.loads((work / "result.json").read_text())
    except (PeerUnavailable, subprocess.TimeoutExpired, OSError, ValueError) as exc:
        bench.skipped["vllm"] = str(exc)
        bench.log(f"vLLM-CPU: skipped: {exc}")
        return
    finally:
        shutil.rmtree(work, ignore_errors=True)
    note = (
        f"vllm {result['vllm']}, dtype={bench.dtype}, VLLM_CPU_KVCACHE_SPACE={space}, "
        f"VLLM_CPU_NUM_OF_RESERVED_CPU={reserved}"
    )
    bench.record("vllm", "vLLM-CPU", result["seconds"], result["tokens"], note)


def check_output_tokens(bench: DtypeBench) -> None:
    """Warn when a system that ran the whole workload produced a different number of tokens."""
    total = len(bench.prompts) * bench.args.output_len
    counts = {k: v["output_tokens"] for k, v in bench.systems.items() if k != "hf_one_at_a_time"}
    bad = {k: n for k, n in counts.items() if n != total}
    if bad:
        bench.log(f"WARNING: expected {total} output tokens, got {bad}")


def ours_tokens_per_s(systems: dict[str, dict], key: str) -> float:
    """Ours against system `key`: vLLM against the mean of the runs of ours around it."""
    runs = [systems["ours"]["tokens_per_s"]]
    if key == "vllm" and "ours_again" in systems:
        runs.append(systems["ours_again"]["tokens_per_s"])
    return statistics.fmean(runs)


def ratios_ours_over(systems: dict[str, dict]) -> dict:
    ratios = {}
    for key, _label, target, _text in SYSTEMS[1:]:
        if key not in systems:
            continue
        ratio = ours_tokens_per_s(systems, key) / systems[key]["tokens_per_s"]
        met = None if target is None else ratio >= target
        ratios[key] = {"ratio": ratio, "target": target, "met": met}
    return ratios


def batch1_latency(requests: int, ours_gaps: list[float], hf_gaps: list[float]) -> dict:
    latency = {
        "method": (
            "ours: wall time of each engine.step() after the first (prefill) step, one request"
            " alone; transformers: gaps between consecutive generated tokens seen by a streamer"
            " in one-at-a-time generate(); p50 over all gaps of the measured requests"
        ),
        "requests": requests,
        "ours_p50_ms": 1e3 * statistics.median(ours_gaps),
        "ours_p90_ms": 1e3 * percentile(ours_gaps, 0.9),
        "hf_generate_p50_ms": 1e3 * statistics.median(hf_gaps) if hf_gaps else None,
        "hf_generate_p90_ms": 1e3 * percentile(hf_gaps, 0.9) if hf_gaps else None,
        "ratio_hf_over_ours": None,
    }
    if hf_gaps:
        latency["ratio_hf_over_ours"] = latency["hf_generate_p50_ms"] / latency["ours_p50_ms"]
    return latency


def bench_dtype(args, dtype: str, prompt_sets, warm_prompts, model_path: Path) -> dict:
    bench = DtypeBench(args, dtype, prompt_sets, warm_prompts)
    ours_config, ours_gaps = measure_ours(bench)
    if "vllm" in args.peers:  # next to ours in time, and ours once more after it
        measure_vllm(bench, model_path)
        if "vllm" in bench.systems:
            measure_ours_again(bench)
    attn, cb_config, hf_gaps = None, None, []
    too_slow = transformers_too_slow(bench, model_path)
    if too_slow:
        bench.skipped["transformers"] = too_slow
        bench.log(f"transformers: skipped: {too_slow}")
    else:
        attn, config, hf_gaps = measure_hf(bench, model_path)
        cb_config = {
            "page_size": cb_page_size(config),
            "num_blocks": config.num_blocks,
            "max_batch_tokens": config.max_batch_tokens,
            "max_requests_per_batch": config.max_requests_per_batch,
        }
    check_output_tokens(bench)
    tokens = bench.tokens
    return {
        "device": str(bench.device),
        "ours_config": ours_config,
        "ours_decode_graphs": bench.graph_sizes,
        "hf_cb_config": cb_config,
        "hf_attn_implementation": attn,
        "systems": bench.systems,
        "ratios_ours_over": ratios_ours_over(bench.systems),
        "batch1_decode_latency": batch1_latency(len(bench.one), ours_gaps, hf_gaps),
        "agreement_with_ours": {
            key: agreement(tokens["ours"], tokens[key]) for key, *_ in SYSTEMS[1:] if key in tokens
        },
        "roofline": roofline(bench, model_path),
        "memory_roofline": memory_roofline(bench, model_path),
        "peers_skipped": bench.skipped,
    }


def print_report(dtype: str, result: dict) -> None:
    systems, ratios = result["systems"], result["ratios_ours_over"]
    graphs = result.get("ours_decode_graphs")
    how = f", ours' decode steps as CUDA graphs ({len(graphs)} batch sizes)" if graphs else ""
    print(f"\n== {dtype} on {result['device']}{how} ==")
    print(f"{'system':<40} {'tok/s':>9} {'ours/x':>8}  {'target':<9} {'met':<4} agrees")
    for key, label, _target, text in SYSTEMS:
        if key not in systems:
            continue
        tps = systems[key]["tokens_per_s"]
        if key == "ours":
            print(f"{label:<40} {tps:>9.1f} {'':>8}  {'':<9} {'':<4}")
            continue
        ratio = ratios[key]
        met = "" if ratio["met"] is None else ("yes" if ratio["met"] else "NO")
        same = result["agreement_with_ours"][key]
        agrees = f"{same['identical']}/{same['compared']}"
        star = " *" if systems[key].get("note") else ""
        row = f"{label + star:<40} {tps:>9.1f} {ratio['ratio']:>7.2f}x"
        print(f"{row}  {text:<9} {met:<4} {agrees}")
    if "ours_again" in systems:
        again = systems["ours_again"]["tokens_per_s"]
        print(f"  ours again right after vLLM: {again:.1f} tok/s; vLLM's ratio is against the"
              f" mean of both runs of ours ({ours_tokens_per_s(systems, 'vllm'):.1f})")  # fmt: skip
    for key, label, *_ in SYSTEMS:
        if systems.get(key, {}).get("note"):
            print(f"  * {label}: {systems[key]['note']}")
    for key, reason in result["peers_skipped"].items():
        print(f"  {key}: skipped: {reason}")
    roof = result["roofline"]
    others = {d: r for d, r in roof.get("gemm_rates", {}).items() if d != roof["dtype"]}
    sizes = roof.get("gemm_sizes", {})
    beaten = "".join(
        f" (faster than {d}'s {r:.3g}"
        + (f" at {sizes[d]}^3)" if sizes.get(d, 0) != roof["gemm_n"] else ")")
        for d, r in others.items()
    )
    if roof["gemm_gflops"] is None:
        print("  compute roofline: measured on CPU only")
    else:
        print(
            f"  compute roofline: a {roof['gemm_n']}^3 {roof['dtype']} GEMM runs at "
            f"{roof['gemm_gflops']:.3g} GFLOP/s here{beaten}; the workload is "
            f"{roof['workload_gflop']:.0f} GFLOP, so "
            + ", ".join(
                f"{k} reaches {v['gflops']:.0f} GFLOP/s = {100 * v['fraction']:.0f} %"
                for k, v in roof["systems"].items()
            )
        )
    print_memory_roofline(result.get("memory_roofline"))
    cb = result["agreement_with_ours"].get("hf_cb")
    if cb is not None:
        verdict = "agree" if all(cb["first_two"]) else "DISAGREE"
        print(f"  sanity: transformers CB vs ours on the first two requests (greedy): {verdict}")
    lat = result["batch1_decode_latency"]
    hf = ""
    if lat["hf_generate_p50_ms"] is not None:
        hf = (
            f", transformers generate {lat['hf_generate_p50_ms']:.2f} ms"
            f" (generate/ours = {lat['ratio_hf_over_ours']:.2f}x)"
        )
    print(
        f"  batch-1 decode p50 per output token ({lat['requests']} requests): "
        f"ours {lat['ours_p50_ms']:.2f} ms{hf}"
    )


# -- main ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["float32", "bfloat16", "float16"],
    )
    parser.add_argument(
        "--model",
        default="demo",
        help="modelWeightPath: a built-in model (demo, smollm2-135m-instruct) or an HF folder",
    )
    parser.add_argument("--requests", type=int, default=None, help="default 32 (8 with --quick)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128 (32)")
    parser.add_argument("--output-len", type=int, default=None, help="default 128 (16)")
    parser.add_argument(
        "--one-at-a-time",
        type=int,
        default=None,
        help="requests measured one at a time (default 4, 2 with --quick)",
    )
    parser.add_argument(
        "--prefill-tokens",
        type=int,
        default=None,
        help="our max_prefill_tokens and CB's max_batch_tokens "
        "(default requests * prompt-len: the whole prefill in one step)",
    )
    parser.add_argument("--block-size", type=int, default=128, help="our KV block size")
    parser.add_argument(
        "--cb-page-size",
        type=int,
        default=128,
        help="transformers CB page size (its default is 256)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs per system after the warm-up, each on prompts of its own (seed + r);"
        " the median is reported",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads for the whole run (default: torch's own choice, not set)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run our decode steps eagerly instead of replaying CUDA graphs",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="reduced smoke-test workload")
    parser.add_argument(
        "--peers",
        nargs="?",
        const="vllm",
        default="",
        choices=["", "vllm"],
        help="also run vLLM's CPU build on the same weights and prompts (its own venv, made on "
        "first use by bench/peers.py; skipped with the reason if it cannot run)",
    )
    parser.add_argument(
        "--peer-timeout", type=float, default=1800.0, help="seconds the vLLM run may take"
    )
    parser.add_argument(
        "--hf-budget",
        type=float,
        default=900.0,
        help="skip the transformers systems in a dtype where, at torch's own GEMM rate, each "
        "would take longer than this many seconds (bfloat16 on CPUs without AVX-512)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON result (default bench/results/engine/<machine kind>/<date>.json, labelled "
        "-MODEL for another --model and -quick with --quick)",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {
        "requests": 8 if quick else 32,
        "prompt_len": 32 if quick else 128,
        "output_len": 16 if quick else 128,
        "one_at_a_time": 2 if quick else 4,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.one_at_a_time = max(1, min(args.one_at_a_time, args.requests))
    if args.prefill_tokens is None:
        args.prefill_tokens = args.requests * args.prompt_len
    args.prefill_tokens = max(args.prefill_tokens, args.prompt_len)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.output_len < 2:
        parser.error("--output-len must be >= 2 (per-token latency needs two tokens)")
    if args.out is None:
        label = "" if args.model == "demo" else Path(args.model).name
        label = "-".join(x for x in (label, "quick" if quick else "") if x)
        args.out = default_out("engine", label)
    return args


def print_header(args, run: Run) -> None:
    machine = run.machine
    threads = "set by --threads" if args.threads is not None else "torch default"
    print(
        f"workload: {args.requests} requests x {args.prompt_len}-token prompts x "
        f"{args.output_len} output tokens, greedy, ignore_eos; repeats={args.repeats}"
    )
    print(
        f"machine: {machine['cpu_model']}, {machine['cpus_usable']} usable CPUs, "
        f"torch {machine['torch']} ({machine['torch_num_threads']} threads, {threads}), "
        f"transformers {machine['transformers']}; loadavg {run.loadavg_start}"
    )


def workload_record(args, vocab: int) -> dict:
    """The workload as the JSON result describes it."""
    return {
        "model": args.model,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "prompt_ids": (
            f"uniform in [0, {vocab}), torch.Generator seed {args.seed} (+ r for repeat r)"
        ),
        "sampling": "greedy, ignore_eos (transformers: eos -1 / min_new_tokens)",
        "one_at_a_time_requests": args.one_at_a_time,
        "repeats": args.repeats,
        "warmup": f"{args.requests} other prompts x {WARMUP_TOKENS} tokens per system",
        "quick": args.quick,
    }


def set_up_process(args) -> None:
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # per-call chatter
    transformers.logging.set_verbosity_error()


def bench_dtype_in_child(args, *rest) -> dict:
    set_up_process(args)
    return bench_dtype(args, *rest)


def bench_dtype_apart(args, *rest) -> dict:
    """`bench_dtype` in a fresh interpreter: a process that has already run the other dtype's
    systems measured our bfloat16 engine ~25 % slower (664 vs 862 tokens/s in one session),
    while vLLM always runs in a process of its own, so each dtype gets a clean process."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(bench_dtype_in_child, args, *rest).result()


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if any(a == "--world-size" or a.startswith("--world-size=") for a in given):
        # tensor parallelism: our engine at world size N against 1 (bench/tensor_parallel.py)
        from bench.tensor_parallel import main as tensor_parallel

        return tensor_parallel(given)
    args = parse_args(argv)
    set_up_process(args)
    gpu = {"gpu": torch.cuda.get_device_name(0)} if torch.cuda.is_available() else {}
    run = Run.begin(
        machine_info(
            ("torch", "transformers"),
            torch_num_threads=torch.get_num_threads(),
            **gpu,
            threads_set_by_bench=args.threads is not None,
        )
    )
    print_header(args, run)
    model_path = resolve_model_path(args.model)
    vocab = prompt_vocab(model_path)
    # Repeat r uses seed + r; the warm-up has prompts of its own (so no prefix cache hits).
    prompt_sets = [
        seeded_prompts(args.requests, args.prompt_len, args.seed + r, vocab)
        for r in range(args.repeats)
    ]
    warm = args.seed + WARMUP_SEED_OFFSET
    warm_prompts = seeded_prompts(args.requests, args.prompt_len, warm, vocab)

    results = {}
    run_dtype = bench_dtype_apart if len(args.dtype) > 1 else bench_dtype
    for dtype in args.dtype:
        results[dtype] = run_dtype(args, dtype, prompt_sets, warm_prompts, model_path)
        print_report(dtype, results[dtype])

    run.write(args.out, workload=workload_record(args, vocab), results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
