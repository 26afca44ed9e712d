"""The machine's rooflines for bench/engine.py: what its GEMMs and its memory can do at best,
and how close each system's run comes to them (compute on CPU, memory bandwidth on an
accelerator); and whether transformers' own systems would take too long to run at all."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from serve_app.engine.backends.cpu import gemm as cpu_gemm

if TYPE_CHECKING:
    from bench.engine import DtypeBench

GEMM_N = 2048  # the roofline's square matmul, smaller where torch is too slow in the dtype
GEMM_SECONDS = 20.0  # at most this long for it
COPY_BYTES = 1 << 31  # the bandwidth probe's copy on an accelerator: many times its cache


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def gemm_gflops(dtype: torch.dtype, n: int = GEMM_N, reps: int = 10) -> tuple[float, int]:
    """This machine's compute roofline as the bench measures it: the GFLOP/s of an n x n input
    through an n x n linear layer's weight, the faster of torch's F.linear (as every model's
    Linear) and, where oneDNN prepacks the dtype, oneDNN's GEMM on the prepacked weight (on AMD
    CPUs torch's float32 F.linear goes to MKL, which takes its AVX2 path there: 209 against
    oneDNN's 454 GFLOP/s on a 2-core Zen 5), and the n it was measured at. Where torch has no
    fast kernel for the dtype (bfloat16 on a CPU without AVX-512: 12-20 GFLOP/s) a smaller n is
    taken, the largest whose products fit in GEMM_SECONDS by a first timing at 256."""
    rate = _matmul_rate(dtype, 256, 1)
    while n > 256 and 2 * n**3 * (reps + 3) / (rate * 1e9) > GEMM_SECONDS:
        n //= 2
    return _matmul_rate(dtype, n, reps), n


def _matmul_rate(dtype: torch.dtype, n: int, reps: int) -> float:
    # F.linear(a, b) = a @ b^T: the weight's layout. A bfloat16 `a @ b` with b as stored takes
    # another path in torch 2.13 on CPUs without AVX-512, ~15x slower (1.2 against 16 GFLOP/s)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    gemms = [partial(F.linear, a, b)]
    if cpu_gemm.onednn_packs(dtype):
        gemms.append(partial(cpu_gemm.PackedLinear(b), a))
    rates = []
    for gemm in gemms:
        for _ in range(3):
            gemm()
        start = time.perf_counter()
        for _ in range(reps):
            gemm()
        rates.append(2 * n**3 * reps / (time.perf_counter() - start) / 1e9)
    return max(rates)


@dataclass(frozen=True)
class Shape:
    """What the FLOP and byte counts need of a model's config.json."""

    layers: int
    q: int  # query heads x head_dim
    kv: int  # KV heads x head_dim
    decoder_weights: int  # elements of the decoder's linears, all layers
    head_weights: int  # elements of the LM head

    @classmethod
    def of(cls, cfg: dict) -> Shape:
        h, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
        head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
        q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
        decoder = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)
        return cls(layers, q, kv, decoder, h * cfg["vocab_size"])


def workload_gflop(model_path: Path, args) -> float:
    """Matmul FLOPs of the workload: every prompt token through the decoder's linears, every
    output token through them and the LM head, plus attention's QK^T and PV over the context."""
    shape = Shape.of(json.loads((model_path / "config.json").read_text()))
    per_token = 2 * shape.decoder_weights
    head = 2 * shape.head_weights
    tokens = args.prompt_len + args.output_len
    attention = 2 * 2 * shape.layers * shape.q * tokens * tokens / 2  # causal: half the scores
    per_request = tokens * per_token + args.output_len * head + attention
    return args.requests * per_request / 1e9


def gemm_rates(bench: DtypeBench) -> dict[str, tuple[float, int]]:
    """torch's GEMM rate and size (gemm_gflops) in the run's dtype, and for bfloat16 in float32
    too; measured once per dtype's run, on CPU only."""
    if bench.gemm is None:
        on_cpu = bench.device is None or bench.device.type == "cpu"
        dtypes = [bench.dtype, *(["float32"] if bench.dtype == "bfloat16" else [])]
        bench.gemm = {d: gemm_gflops(getattr(torch, d)) for d in dtypes} if on_cpu else {}
    return bench.gemm


def roofline(bench: DtypeBench, model_path: Path) -> dict:
    """The workload's GFLOP/s per system as a fraction of the machine's GEMM rate. A bfloat16
    model's roof is the faster of the bfloat16 and float32 GEMMs: on a CPU without bfloat16
    arithmetic, bfloat16 weights are fastest multiplied as float32 (what our kernels do)."""
    measured = gemm_rates(bench)
    rates = {d: rate for d, (rate, _n) in measured.items()}
    roof_dtype = max(rates, key=rates.get) if rates else bench.dtype
    peak = rates.get(roof_dtype)
    work = workload_gflop(model_path, bench.args)
    systems = {}
    for key in ("ours", "vllm"):
        if key in bench.systems and peak:
            gflops = work / bench.systems[key]["seconds"]
            systems[key] = {"gflops": gflops, "fraction": gflops / peak}
    n = measured[roof_dtype][1] if peak else GEMM_N
    sizes = {d: size for d, (_rate, size) in measured.items()}
    return {"dtype": roof_dtype, "gemm_n": n, "gemm_gflops": peak, "gemm_rates": rates,
            "gemm_sizes": sizes, "workload_gflop": work, "systems": systems}  # fmt: skip


def copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES, reps: int = 10) -> float:
    """The device memory's bandwidth as the bench measures it: GB/s of a device-to-device
    copy of nbytes, counting the bytes read and the bytes written."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - start) / 1e9


def decode_bytes(cfg: dict, element_size: int) -> tuple[int, int]:
    """What one decode step must read from device memory at least: every weight of the decoder's
    linears and the LM head once (the embedding is gathered, a row per token), and per cached
    token its K and V in every layer. Returns (weight bytes, KV bytes per cached token)."""
    shape = Shape.of(cfg)
    weights = shape.decoder_weights + shape.head_weights
    return weights * element_size, 2 * shape.layers * shape.kv * element_size


def memory_roofline(bench: DtypeBench, model_path: Path) -> dict | None:
    """On an accelerator, decoding is bound by memory bandwidth, not arithmetic: the bytes a
    decode step must read (decode_bytes) over its time, as a fraction of the copy bandwidth
    measured here. Ours at the full batch from its steady decode steps (the median step, at the
    median context); every system over its whole run from the bytes all its steps must read
    (prefill counted as one read of the weights). None on CPU (the compute roofline's place)."""
    if bench.device is None or bench.device.type == "cpu":
        return None
    args = bench.args
    cfg = json.loads((model_path / "config.json").read_text())
    element = torch.empty((), dtype=getattr(torch, bench.dtype)).element_size()
    weights, per_token = decode_bytes(cfg, element)
    bandwidth = copy_bandwidth(bench.device)
    contexts = range(args.prompt_len, args.prompt_len + args.output_len - 1)
    workload = args.output_len * weights + args.requests * per_token * sum(contexts)
    result = {
        "copy_gbps": bandwidth,
        "weight_bytes": weights,
        "kv_bytes_per_token": per_token,
        "workload_bytes": workload,
        "systems": {},
    }
    for key, system in bench.systems.items():
        if key == "hf_one_at_a_time":  # a few requests at batch 1: another workload
            continue
        gbps = workload / system["seconds"] / 1e9
        result["systems"][key] = {"gbps": gbps, "fraction": gbps / bandwidth}
    if bench.batch_steps:
        step = statistics.median(bench.batch_steps)
        context = args.prompt_len + args.output_len // 2
        gbps = (weights + args.requests * context * per_token) / step / 1e9
        result["ours_decode_step"] = {
            "batch": args.requests,
            "context": context,
            "step_ms": 1e3 * step,
            "gbps": gbps,
            "fraction": gbps / bandwidth,
        }
    return result


def transformers_too_slow(bench: DtypeBench, model_path: Path) -> str:
    """Why the transformers systems are skipped in this dtype, or "": at torch's own GEMM rate
    in the dtype, the static batch alone (the fastest of them) would take longer than
    --hf-budget seconds (a torch whose kernels for the dtype are reference loops)."""
    rate = gemm_rates(bench).get(bench.dtype, (None, 0))[0]
    if not rate:
        return ""
    seconds = workload_gflop(model_path, bench.args) / rate
    if seconds <= bench.args.hf_budget:
        return ""
    return (
        f"torch's {bench.dtype} GEMM runs at {rate:.1f} GFLOP/s on this CPU, so each "
        f"transformers system would take ~{seconds / 60:.0f} min (--hf-budget "
        f"{bench.args.hf_budget:.0f} s)"
    )


def print_memory_roofline(mem: dict | None) -> None:
    if mem is None:
        return
    print(
        f"  memory roofline: a device-to-device copy moves {mem['copy_gbps']:.0f} GB/s here"
        f" (read + written); a decode step reads {mem['weight_bytes'] / 1e9:.2f} GB of weights"
        f" + {mem['kv_bytes_per_token'] / 1e3:.0f} kB per cached token"
    )
    step = mem.get("ours_decode_step")
    if step:
        print(
            f"  ours, decode step at batch {step['batch']} (context {step['context']}): "
            f"{step['step_ms']:.2f} ms = {step['gbps']:.0f} GB/s = "
            f"{100 * step['fraction']:.1f} % of the copy bandwidth"
        )
    whole = ", ".join(
        f"{k} {v['gbps']:.0f} GB/s = {100 * v['fraction']:.1f} %" for k, v in mem["systems"].items()
    )
    print(f"  whole runs (the bytes every step must read over the run's time): {whole}")
