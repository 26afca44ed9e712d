"""Tensor parallelism on one machine: the engine at world size 1 and N on the same workload.

    .venv/bin/python -m bench.engine --world-size 2                  # demo, 2 ranks vs 1
    .venv/bin/python -m bench.tensor_parallel --world-size 3 --model smollm2-135m-instruct
    .venv/bin/python -m bench.tensor_parallel --world-size 2 --quick  # a smoke test

For each world size, one LLM (ranks 1..N-1 as processes of this machine, gloo between them on
CPU) generates the same greedy, EOS-free batch after a warm-up; the result is output tokens per
second and each rank's memory: its resident set (everything the process holds: weights, KV
cache, torch and Python) and rank 0's KV cache bytes. The greedy tokens of the two runs are
compared, so a figure never comes from a split that computes something else.

On CPU the ranks share the machine's cores and memory bandwidth: a split model is not faster
there, it only spreads what each process holds. What TP is for is device memory: N NPUs hold a
model N times larger, and N times the KV cache, than one.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import psutil

from bench.common import Run, default_out, log, machine_info, prompt_vocab, seeded_prompts
from serve_app.engine import LLM, SamplingParams
from serve_app.models.loader import resolve_model_path

MIB = 1 << 20


def measure(model: str, world: int, prompts: list[list[int]], output_len: int, **engine) -> dict:
    """One world size: tokens per second over the batch, each rank's memory, the tokens."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    with LLM(model, world_size=world, device="cpu", **engine) as llm:
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        runner = llm.engine.runner
        ranks = [psutil.Process()]
        if runner.local_ranks is not None:
            ranks += [psutil.Process(p.pid) for p in runner.local_ranks.processes]
        rss = [round(p.memory_info().rss / MIB) for p in ranks]
        kv = sum(t.nbytes for pair in runner.kv_caches for t in pair)
    tokens = [o.outputs[0].token_ids for o in outputs]
    generated = sum(len(t) for t in tokens)
    return {
        "world_size": world,
        "output_tokens_per_s": round(generated / wall, 1),
        "wall_s": round(wall, 3),
        "rank_rss_mib": rss,
        "rank0_kv_cache_mib": round(kv / MIB, 1),
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, required=True, help="N, compared with 1")
    parser.add_argument("--model", default="demo", help="a built-in name or a folder")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=None, help="default 16 (2 with --quick)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128 (16)")
    parser.add_argument("--output-len", type=int, default=None, help="default 64 (8)")
    parser.add_argument("--kv-blocks", type=int, default=256, help="KV blocks of 16 tokens")
    parser.add_argument("--quick", action="store_true", help="a small workload (smoke test)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="the JSON result's path")
    args = parser.parse_args(argv)
    requests = args.requests or (2 if args.quick else 16)
    prompt_len = args.prompt_len or (16 if args.quick else 128)
    output_len = args.output_len or (8 if args.quick else 64)
    run = Run.begin(machine_info(("torch", "transformers")))
    vocab = prompt_vocab(resolve_model_path(args.model))
    prompts = seeded_prompts(requests, prompt_len, args.seed, vocab)
    engine = dict(dtype=args.dtype, block_size=16, num_kv_blocks=args.kv_blocks)
    results = []
    for world in (1, args.world_size):
        log(f"world size {world}: {requests} x {prompt_len} tokens -> {output_len} ...")
        results.append(measure(args.model, world, prompts, output_len, **engine))
        r = results[-1]
        log(f"  {r['output_tokens_per_s']} tok/s, rank RSS {r['rank_rss_mib']} MiB, "
            f"rank 0 KV {r['rank0_kv_cache_mib']} MiB")  # fmt: skip
    one, split = results
    same = one.pop("tokens") == split.pop("tokens")
    if not same:
        log("the split model's greedy tokens differ from world size 1's: no figure")
        return 1
    ratio = split["output_tokens_per_s"] / one["output_tokens_per_s"]
    log(f"world size {args.world_size} / 1: {ratio:.2f}x the throughput, same greedy tokens")
    out = args.out or default_out("tensor_parallel", f"{args.model}-tp{args.world_size}")
    run.write(
        out, model=args.model, dtype=args.dtype, requests=requests, prompt_len=prompt_len,
        output_len=output_len, results=results, throughput_ratio=round(ratio, 3),
        same_tokens=same,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
