"""stopInfer: client-visible request ids (Triton `id`) -> the event that stops that request.

Each ingress replica keeps its own `StopRegistry` of the requests it serves. With several
ingress replicas a stopInfer may reach another replica than the request; then one more
`StopRegistry` runs as a deployment of its own ("StopRegistry", one replica), where every ingress
replica holds each of its requests' ids (`hold`, a call that returns when the id is stopped and
is cancelled when the request ends), and where a replica that does not know an id passes the stop
on (`stop`). One replica: no shared registry, no extra call per request.
"""

from __future__ import annotations

import asyncio

from serve_app.messages import ErrorKind
from serve_app.protocol.errors import APIError


class StopRegistry:
    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def register(self, key: str) -> asyncio.Event:
        if key in self._events:
            raise APIError(
                ErrorKind.VALIDATION, f"a request with id {key!r} is already running", "id"
            )
        event = self._events[key] = asyncio.Event()
        return event

    def unregister(self, key: str, event: asyncio.Event) -> None:
        if self._events.get(key) is event:
            del self._events[key]

    def stop(self, key: str) -> bool:
        event = self._events.get(key)
        if event is None:
            return False
        event.set()
        return True

    async def hold(self, key: str) -> bool:
        """The shared registry's side of a request on some ingress replica: returns True once
        `stop(key)` is called; the caller cancels it when its request ends first."""
        # the same id on two replicas at once: the newer one is the one a stop reaches
        event = self._events[key] = asyncio.Event()
        try:
            await event.wait()
            return True
        finally:
            self.unregister(key, event)

    async def stop_held(self, key: str) -> bool:
        """The shared registry's `stop`, on the event loop where the holds wait."""
        return self.stop(key)
