"""Ranks 1..world-1 of an engine that has no Ray to place them: processes of this machine."""

from __future__ import annotations

import pickle
import subprocess
import sys

from serve_app.engine.config import EngineConfig

# each a fresh interpreter running the rank's life (worker.py)
START = "from serve_app.engine.backends.parallel.worker import _main; _main()"


class LocalRanks:
    """Ranks 1..world-1 as processes of this machine, each a fresh interpreter. Each watches its
    stdin: when this process goes, however it goes, the pipe closes and the rank exits."""

    def __init__(self, config: EngineConfig) -> None:
        self.processes = []
        for rank in range(1, config.world_size):
            process = subprocess.Popen([sys.executable, "-c", START], stdin=subprocess.PIPE)
            process.stdin.write(pickle.dumps((config, rank)))
            process.stdin.flush()
            self.processes.append(process)

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
