"""A rank other than 0: loads its part of the model and runs what rank 0 tells it, step by step.

`serve` is the whole life of such a rank, wherever it runs: a process of its own next to an
offline engine or an engine process (`local.LocalRanks` starts it with `_main`), or a Ray actor
in the model replica's placement group (serve_app/replica/ranks.py).
"""

from __future__ import annotations

import os
import pickle
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


def _orphaned(stdin) -> None:
    stdin.read()  # returns at EOF: the engine's process closed the pipe or is gone
    os._exit(0)


def _main() -> None:
    stdin = sys.stdin.buffer
    config, rank = pickle.load(stdin)
    threading.Thread(target=_orphaned, args=(stdin,), daemon=True).start()
    serve(config, rank)
