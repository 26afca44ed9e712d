"""The engine in the server's CPU layout against torch's threads on every core, in one process.

    .venv/bin/python -m bench.layout                          # demo, bfloat16, 32 x 128 x 128
    .venv/bin/python -m bench.layout --engine-cpus 3 --spare-cpus 0-2 --rounds 6
    .venv/bin/python -m bench.layout --dtype float32

The server's default layout on CPU (deployments.yaml: engineProcess, engineCpus, engineSpareCpus)
runs the step loop on its own cores with a torch thread each and lends it helper threads on the
serving path's cores at idle priority; the offline figure that bench/http_vs_offline.py compares
HTTP with (bench/engine.py) gives torch a thread on every core. What HTTP keeps of the offline
engine is the product of two shares: what the layout keeps on an idle machine (measured here)
and what the serving path leaves of the helpers' cores (http_vs_offline.py's CPU split).

On a machine whose speed drifts, two processes measured a minute apart differ by more than the
layouts do, so one engine switches layout between rounds (the process's cores, torch's threads,
the helpers) and each round runs the same workload in both: every prompt prefilled in one step,
then the decode steps (EOS ignored). Per layout it reports the median prefill step, decode step
and tokens/s over the rounds, the served layout's ratio to the other, and how the shared chunks
were split (the step loop's, the helpers', and the helpers' that the step loop took back).

With `--engine-process` a third arm runs each round too: the server's own engine process
(AsyncEngine with deployments.yaml's engine settings, but the model, dtype, KV blocks and cores
of this run: the step loop bound to the served layout's cores, its helpers on the others) fed
by `--requests`
closed-loop streams from this process, each sending `--process-requests` requests one after
the other, as a load generator's streams do over HTTP: prompts arrive staggered and are
prefilled a few at a time beside the others' decodes, and every step's outputs cross to this
process. Everything HTTP adds beyond that arm is the serving path's (ingress, model replica,
Ray, the load generator). Its figure is output tokens per second over the arm's wall time.
Linux, the engine's CPU kernels and two cores or more.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

from bench.common import Run, default_out, log, machine_info, seeded_prompts  # noqa: E402
from serve_app import placement  # noqa: E402
from serve_app.engine.backends.cpu import kernels as cpu_kernels  # noqa: E402
from serve_app.engine.backends.cpu.spare_cores import lend_spare_cores  # noqa: E402
from serve_app.placement import (  # noqa: E402
    available_cores,
    bind_process,
    format_cpus,
    parse_cpus,
)

LAYOUTS = ("served", "all_cores")
PROCESS = "engine_process"


class Layouts:
    """Switches this process between the served layout (bound to `engine`, a torch thread per
    core of it, helpers on `spare`) and torch's threads on every core of `every`."""

    def __init__(self, engine: tuple[int, ...], spare: tuple[int, ...], every: set[int]):
        self.engine, self.spare, self.every = engine, spare, every
        self._use = cpu_kernels.op("use_spare_cpus")
        self._stats = cpu_kernels.op("spare_cores_stats")

    def switch(self, layout: str | None) -> None:
        """To `layout`; None: none (no helpers, one torch thread), while another engine runs."""
        self._use([])  # no helpers while the process's cores change (they keep to their own)
        if layout is None:
            torch.set_num_threads(1)
        elif layout == "served":
            bind_process(self.engine)
            torch.set_num_threads(len(self.engine))
            if lend_spare_cores(self.spare) != len(self.spare):
                raise RuntimeError(f"helpers on cores {format_cpus(self.spare)} did not start")
        else:
            bind_process(self.every)
            torch.set_num_threads(len(self.every))

    def chunks(self) -> list[int]:
        """Chunks so far: the step loop's, the helpers', taken back from late helpers."""
        return list(self._stats())[:3]


class ProcessArm:
    """The server's engine process on the served layout's cores, fed by closed-loop streams from
    this process, which keeps to the helpers' cores meanwhile (as the serving path does)."""

    def __init__(self, args):
        import dataclasses

        import yaml

        from bench.engine import kv_blocks  # bench/engine.py's sizing, as the offline arms have it
        from serve_app.config import load_config
        from serve_app.engine.host.async_engine import AsyncEngine

        self.args = args
        spec = yaml.safe_load((ROOT / "deployments.yaml").read_text(encoding="utf-8"))
        served = load_config(spec["applications"][0]["args"]).engine_config()
        config = dataclasses.replace(
            served, model=args.model, dtype=args.dtype, block_size=args.block_size,
            num_kv_blocks=kv_blocks(args), engine_process=True, engine_cpus=args.engine,
            engine_spare_cpus=args.spare,
        )  # fmt: skip
        self.engine = AsyncEngine(config)

    def run(self, prompts: list[list[int]]) -> dict:
        bind_process(self.args.spare)
        start = time.perf_counter()
        done = asyncio.run(self._streams(prompts))
        wall = time.perf_counter() - start
        return {"prefill_ms": None, "decode_step_ms": None, "requests": len(prompts),
                "completed": done, "tokens_per_s": done * self.args.output_len / wall}  # fmt: skip

    async def _streams(self, prompts: list[list[int]]) -> int:
        """Every prompt, `--requests` at a time, each stream sending its next when its last ended;
        how many ended with all their tokens."""
        from serve_app.engine.inputs import EngineRequest
        from serve_app.engine.params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=self.args.output_len, ignore_eos=True)
        todo, done = list(enumerate(prompts)), 0

        async def stream() -> None:
            nonlocal done
            while todo:
                i, prompt = todo.pop(0)
                request = EngineRequest(f"layout-{i}-{time.monotonic_ns()}", prompt, params)
                outputs = [out async for out in self.engine.generate(request)]
                done += len(outputs[-1].outputs[0].token_ids) == self.args.output_len

        await asyncio.gather(*(stream() for _ in range(self.args.requests)))
        return done

    def shutdown(self) -> None:
        self.engine.shutdown()


def check_cores(engine: tuple[int, ...], spare: tuple[int, ...]) -> None:
    if cpu_kernels.op("use_spare_cpus") is None:
        raise SystemExit("layout: the engine's CPU kernels are not built here (see cpu_kernels)")
    if not engine or not spare or set(engine) & set(spare):
        raise SystemExit("layout: --engine-cpus and --spare-cpus must be two disjoint core lists")
    try:
        placement.check_cores(set(engine) | set(spare))
    except ValueError as exc:
        raise SystemExit(f"layout: {exc}") from None


def engine_args(args) -> argparse.Namespace:
    """bench/engine.py's sizing of our engine (build_ours) for this workload: every prompt
    prefilled in one step."""
    return argparse.Namespace(
        model=args.model, prompt_len=args.prompt_len, output_len=args.output_len,
        requests=args.requests, prefill_tokens=args.requests * args.prompt_len,
        block_size=args.block_size, enforce_eager=False,
    )  # fmt: skip


def run_once(llm, prompts: list[list[int]], output_len: int) -> dict:
    """The prompts together (bench/engine.py's `ours_steps`): the first step (every prefill),
    the decode steps' median, and output tokens (each prompt's `output_len`) per second."""
    from bench.engine import ours_steps

    steps = ours_steps(llm, prompts, output_len)
    return {
        "prefill_ms": 1e3 * steps[0],
        "decode_step_ms": 1e3 * statistics.median(steps[1:]) if len(steps) > 1 else None,
        "tokens_per_s": len(prompts) * output_len / sum(steps),
    }


def _figures(result: dict) -> str:
    step = result["decode_step_ms"]
    decode = "no decode step" if step is None else f"decode step {step:.2f} ms"
    return f"prefill {result['prefill_ms']:.1f} ms, {decode}, {result['tokens_per_s']:.1f} tokens/s"


def summarize(rounds: dict[str, list[dict]]) -> dict:
    """Per layout the medians over the rounds; the served layout's ratios to the other (time:
    > 1 is slower; throughput: < 1 keeps less)."""
    medians = {
        layout: {
            key: statistics.median(r[key] for r in runs if r[key] is not None)
            for key in ("prefill_ms", "decode_step_ms", "tokens_per_s")
            if any(r[key] is not None for r in runs)
        }
        for layout, runs in rounds.items()
    }
    served, other = medians["served"], medians["all_cores"]
    ratios = {key: served[key] / other[key] for key in served if key in other and other[key]}
    summary = {"medians": medians, "served_over_all_cores": ratios}
    if PROCESS in rounds:  # per round against the offline layout of the same round
        pairs = zip(rounds[PROCESS], rounds["all_cores"], strict=True)
        summary["engine_process_over_all_cores"] = statistics.mean(
            p["tokens_per_s"] / a["tokens_per_s"] for p, a in pairs
        )
    return summary


def measure(args, llm, layouts: Layouts, process: ProcessArm | None = None) -> dict:
    arms = LAYOUTS + ((PROCESS,) if process else ())
    rounds: dict[str, list[dict]] = {arm: [] for arm in arms}
    chunks = [0, 0, 0]
    for layout in LAYOUTS:  # warm each layout once (thread pools, the chunk sizes' speeds)
        layouts.switch(layout)
        run_once(llm, seeded_prompts(args.requests, args.prompt_len, args.seed + 1), 4)
    if process:
        layouts.switch(None)
        process.run(seeded_prompts(args.requests, args.prompt_len, args.seed + 2))
    for r in range(args.rounds):
        prompts = seeded_prompts(args.requests, args.prompt_len, args.seed + 100 + r)
        for layout in arms if r % 2 == 0 else reversed(arms):
            if layout == PROCESS:
                layouts.switch(None)
                seed = args.seed + 1000 * (r + 1)
                result = process.run(seeded_prompts(args.requests * args.process_requests,
                                                    args.prompt_len, seed))  # fmt: skip
                rounds[layout].append(result)
                log(f"round {r + 1} {layout}: {result['tokens_per_s']:.1f} tokens/s")
                continue
            layouts.switch(layout)
            before = layouts.chunks()
            result = run_once(llm, prompts, args.output_len)
            if layout == "served":
                after = layouts.chunks()
                chunks = [c + b - a for c, a, b in zip(chunks, before, after, strict=True)]
            rounds[layout].append(result)
            log(f"round {r + 1} {layout}: " + _figures(result))
    return {
        "rounds": rounds,
        **summarize(rounds),
        "served_chunks_per_round": {
            name: c / args.rounds
            for name, c in zip(("step_loop", "helpers", "taken_back"), chunks, strict=True)
        },
    }


def _row(label: str, figures: dict, formats: tuple[str, str, str]) -> str:
    keys, widths = ("prefill_ms", "decode_step_ms", "tokens_per_s"), (10, 15, 9)
    columns = zip(keys, widths, formats, strict=True)
    cells = (format(figures.get(key, float("nan")), f"{w}{f}") for key, w, f in columns)
    return f"{label:56s} " + " ".join(cells)


def print_table(result: dict, engine: tuple[int, ...], spare: tuple[int, ...], every) -> None:
    m, ratio = result["medians"], result["served_over_all_cores"]
    labels = {
        "served": f"served: step loop on {format_cpus(engine)}, helpers on {format_cpus(spare)}",
        "all_cores": f"all cores: {len(every)} torch threads",
    }
    print(f"\n{'layout':56s} {'prefill ms':>10s} {'decode step ms':>15s} {'tokens/s':>9s}")
    for layout in LAYOUTS:
        print(_row(labels[layout], m[layout], (".1f", ".2f", ".1f")))
    print(_row("served / all cores", ratio, (".3f", ".3f", ".3f")))
    if PROCESS in m:
        label = f"engine process on {format_cpus(engine)}, helpers on {format_cpus(spare)}"
        print(_row(label, m[PROCESS], (".1f", ".2f", ".1f")))
        over = {"tokens_per_s": result["engine_process_over_all_cores"]}
        print(_row("engine process / all cores (mean of the rounds' ratios)", over,
                   (".3f", ".3f", ".3f")))  # fmt: skip
    split = result["served_chunks_per_round"]
    print(f"served layout's shared chunks per round: step loop {split['step_loop']:.0f}, helpers "
          f"{split['helpers']:.0f}, taken back from helpers {split['taken_back']:.0f}")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    every = sorted(available_cores())
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="a built-in model name or a weights folder")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--engine-cpus", default=format_cpus(every[-1:]), help="the served layout's "
                   "step-loop cores (default: the last core)")  # fmt: skip
    p.add_argument("--spare-cpus", default=format_cpus(every[:-1]), help="its helpers' cores "
                   "(default: every other core)")  # fmt: skip
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4, help="runs of each layout, alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-process", action="store_true", help="a third arm: the server's "
                   "engine process fed by closed-loop streams from this process")  # fmt: skip
    p.add_argument("--process-requests", type=int, default=3, help="requests each stream of "
                   "the engine-process arm sends in a round, one after the other")  # fmt: skip
    p.add_argument("--out", type=Path, default=default_out("layout"))
    args = p.parse_args(argv)
    for name in ("requests", "prompt_len", "output_len", "rounds", "process_requests"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        args.engine, args.spare = parse_cpus(args.engine_cpus), parse_cpus(args.spare_cpus)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    every = available_cores()
    check_cores(args.engine, args.spare)
    from bench.engine import (
        build_ours,  # bench/engine.py: the same engine sizing as the offline figure
    )

    run = Run.begin(machine_info(("torch",)))
    log(f"loading {args.model} ({args.dtype}) ...")
    llm = build_ours(engine_args(args), args.dtype)
    layouts, threads = Layouts(args.engine, args.spare, every), torch.get_num_threads()
    process = None
    try:
        if args.engine_process:
            log("starting the engine process ...")
            process = ProcessArm(args)
        result = measure(args, llm, layouts, process)
    finally:  # as it was: every core, no helpers, torch's threads
        if process is not None:
            process.shutdown()
        layouts.switch("all_cores")
        torch.set_num_threads(threads)
    print_table(result, args.engine, args.spare, every)
    workload = {k: getattr(args, k) for k in ("model", "dtype", "requests", "prompt_len",
                                                "output_len", "rounds", "seed", "engine_process",
                                                "process_requests")}  # fmt: skip
    workload.update(engine_cpus=args.engine_cpus, spare_cpus=args.spare_cpus)
    run.write(args.out, workload=workload, **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
