"""The engine's step loop on a thread of the serving process (ModelConfig `engineProcess: false`).

The same host interface as the engine process (`process.EngineProcess`): `send` a message,
`is_running`, `stats`, `shutdown`, `info`; outputs go to `deliver` from the loop's thread. Adding
and aborting go through an inbox the loop drains before each step, so the engine itself stays
single-threaded.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from serve_app.engine.host.process import EngineInfo
from serve_app.engine.host.step_loop import IDLE_WAIT_S, Items, run_steps

if TYPE_CHECKING:
    from serve_app.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineThread:
    def __init__(
        self,
        engine: LLMEngine,
        deliver: Callable[[Items], None],
        on_exit: Callable[[str], None],
    ) -> None:
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self._deliver = deliver
        self._on_exit = on_exit
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return not self._stopped and self._thread.is_alive()

    def stats(self) -> dict:
        return self.engine.stats()

    def send(self, message: tuple[str, object]) -> None:
        self._inbox.put(message)
        self._wake.set()

    def shutdown(self, timeout: float = 10) -> None:
        self.send(("stop", None))
        self._thread.join(timeout=timeout)

    def _receive(self, idle: bool) -> list:
        if idle:
            self._wake.wait(timeout=IDLE_WAIT_S)
            self._wake.clear()
        messages = []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages

    def _run(self) -> None:
        try:
            run_steps(self.engine, self._receive, self._deliver)
        except BaseException:
            logger.exception("the engine loop crashed")
        finally:
            # stopped or dead: nothing will answer a stream any more, so fail those left
            self._stopped = True
            self._on_exit("the engine loop is not running")
            self.engine.close()  # the other ranks, where the model is split over several
