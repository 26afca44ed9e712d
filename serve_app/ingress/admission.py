"""Admission: `ServerConfig.maxLinkNum` requests at once, twice as many waiting, the rest refused.

MindIE serves `maxLinkNum` connections, queues twice as many and refuses the rest. Here an ASGI
middleware inside the body reader (so a client still uploading holds no slot) counts the
requests that do work, every POST but stopInfer, which frees work and must get through an
overloaded server. A request over the running limit waits, first come first served, for one to
finish; one over the queue's bound is answered at once with kind `overloaded` in its family's
envelope (503; 429 on the Databricks paths, whose SDK retries it) and `Retry-After`. A waiting
client that goes away leaves the queue. GETs (health, readiness, metrics, model lists) are
never held back.

The limits are per ingress replica: `maxLinkNum` split over the ingress's `num_replicas`
(`deployment_options.py` gives Ray Serve's own limits room above these, so that overflow reaches
this middleware and gets an envelope rather than Ray's plain-text 503).
"""

from __future__ import annotations

import asyncio
from collections import deque

from serve_app.ingress.request_body import ASGIApp, Receive, Scope, Send, error_response
from serve_app.messages import ErrorKind
from serve_app.protocol.errors import APIError

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, app: ASGIApp, limit: int, queue: int) -> None:
        if limit < 1 or queue < 0:
            raise ValueError(f"admission needs limit >= 1 and queue >= 0, got {limit}, {queue}")
        self.app = app
        self.limit = limit
        self.queue = queue
        self.running = 0
        self.waiting: deque[asyncio.Future] = deque()
        self.refused = 0  # requests answered `overloaded` since start

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _counted(scope):
            await self.app(scope, receive, send)
            return
        if not await self._enter():
            self.refused += 1
            await _overloaded(self, scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self._leave()

    async def _enter(self) -> bool:
        """True once the request holds a slot; False when it must be refused."""
        if self.running < self.limit and not self.waiting:
            self.running += 1
            return True
        if len(self.waiting) >= self.queue:
            return False
        turn = asyncio.get_running_loop().create_future()
        self.waiting.append(turn)
        try:
            await turn  # resolved by _leave, which hands over its slot
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._leave()  # the slot came just as the client went: pass it on
            else:
                self.waiting.remove(turn)
            raise
        return True

    def _leave(self) -> None:
        while self.waiting:
            turn = self.waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot goes to the longest waiter: running unchanged
                return
        self.running -= 1


def _counted(scope: Scope) -> bool:
    if scope["type"] != "http" or scope["method"] != "POST":
        return False
    return not scope["path"].rstrip("/").endswith("/stopInfer")


async def _overloaded(admission: Admission, scope: Scope, receive: Receive, send: Send) -> None:
    error = APIError(
        ErrorKind.OVERLOADED,
        f"the server is at its limit of {admission.limit} requests running and "
        f"{admission.queue} waiting (ServerConfig.maxLinkNum); retry after "
        f"{RETRY_AFTER_S} s",
    )
    response = error_response(error, scope["path"])
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    await response(scope, receive, send)
