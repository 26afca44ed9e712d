"""A rank other than 0: loads its part of the model and runs what rank 0 tells it, step by step.

`serve` is the whole life of such a rank, wherever it runs: a process of its own next to an
offline engine or an engine process (`start_local`, below), or a Ray actor in the model
replica's placement group (serve_app/replica/ranks.py).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading

from serve_app.engine.config import EngineConfig


def serve(config: EngineConfig, rank: int) -> None:
    """Join the ranks at config.tp_rendezvous, load this rank's part, follow rank 0 until it
    says stop."""
    import torch

    from serve_app.engine.backends.runner import ModelRunner

    if config.device == "cpu" or not torch.cuda.is_available():
        # the ranks share the machine's cores (rank 0 keeps the threads its engine was given)
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // config.world_size))
    runner = ModelRunner(config, with_tokenizer=False, rank=rank)
    try:
        runner.follow()
    finally:
        runner.close()


class LocalRanks:
    """Ranks 1..world-1 as processes of this machine, each a fresh interpreter. Each watches its
    stdin: when this process goes, however it goes, the pipe closes and the rank exits."""

    def __init__(self, config: EngineConfig) -> None:
        start = f"from {__name__} import _main; _main()"
        self.processes = []
        for rank in range(1, config.world_size):
            process = subprocess.Popen([sys.executable, "-c", start], stdin=subprocess.PIPE)
            process.stdin.write(pickle.dumps((config, rank)))
            process.stdin.flush()
            self.processes.append(process)

    def dead(self) -> list[int]:
        """The ranks whose process has exited."""
        return [r for r, p in enumerate(self.processes, 1) if p.poll() is not None]

    def close(self, timeout: float = 10) -> None:
        for process in self.processes:
            try:
                process.stdin.close()
            except OSError:
                pass
        for process in self.processes:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _orphaned(stdin) -> None:
    stdin.read()  # returns at EOF: the engine's process closed the pipe or is gone
    os._exit(0)


def _main() -> None:
    stdin = sys.stdin.buffer
    config, rank = pickle.load(stdin)
    threading.Thread(target=_orphaned, args=(stdin,), daemon=True).start()
    serve(config, rank)
