"""Control over an in-process engine's steps, for tests whose verdict must not depend on how fast
the machine is (not a test module).

`Stepping(engine, monkeypatch)` wraps the engine's `step` (the engine loop calls it on its own
thread): it counts the steps, gives each one a floor on its duration (`pace_s`: a request of N
tokens then takes at least N * pace_s on any machine, so "still running after t seconds" or
"timed out before its end" is a fact, not a race), and holds the engine before a given step
until the test lets it go (so "the consumer has seen the first token before the second exists"
is arranged, not hoped for).
"""

from __future__ import annotations

import threading
import time

# A held step goes on by itself after this long, so that a test that fails before it releases
# the engine does not leave it stuck for the tests after it.
HOLD_LIMIT_S = 30.0


class Stepping:
    def __init__(self, engine, monkeypatch, pace_s: float = 0.0) -> None:
        self.steps = 0
        self.pace_s = pace_s
        self._holds: dict[int, threading.Event] = {}
        self._changed = threading.Condition()
        original = engine.step

        def step():
            number = self.steps + 1
            hold = self._holds.pop(number, None)
            if hold is not None:
                hold.wait(HOLD_LIMIT_S)
            if self.pace_s:
                time.sleep(self.pace_s)
            outputs = original()
            with self._changed:
                self.steps = number
                self._changed.notify_all()
            return outputs

        monkeypatch.setattr(engine, "step", step)

    def hold_before(self, number: int) -> threading.Event:
        """The engine waits before its step `number` (counted from now, 1-based) until the
        returned event is set (or HOLD_LIMIT_S has passed)."""
        event = self._holds[self.steps + number] = threading.Event()
        return event

    def wait_for(self, steps: int, timeout_s: float = 60.0) -> bool:
        """True once the engine has run `steps` steps in all (counted since the wrap)."""
        with self._changed:
            return self._changed.wait_for(lambda: self.steps >= steps, timeout_s)
