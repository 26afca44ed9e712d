"""The engine's step loop, the same whether it runs on a thread or in a process of its own.

Messages in: ("add", EngineRequest), ("abort", request_id), ("stop", None). Out, once per loop
turn that produced anything: a list of (request id, RequestOutput or exception), the outputs of
one step plus what adding and aborting gave (a refusal, an aborted request's last output).

A step that raises ends the loop: its requests fail with an `EngineError` (the details go to the
log), and the loop returns, since the engine's state (KV pool, device) can no longer be trusted.
The replica's health check then fails and Ray Serve replaces it (as vLLM's engine goes dead).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from serve_app.engine.errors import EngineError, RankFailure, RequestRejected
from serve_app.engine.inputs import EngineRequest

if TYPE_CHECKING:  # a process that hosts the engine in a child imports no model code
    from serve_app.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
Items = list[tuple[str, object]]
IDLE_WAIT_S = 0.5  # longest wait for a message while there is nothing to step


def run_steps(
    engine: LLMEngine,
    receive: Callable[[bool], list[tuple[str, object]]],
    deliver: Callable[[Items], None],
) -> None:
    """Steps until a ("stop", None) message. `receive(idle)` returns the messages waiting; when
    `idle` (no request to step) it may first wait a while for one."""
    while True:
        items: Items = []
        for kind, payload in receive(not engine.has_unfinished_requests()):
            if kind == "stop":
                return
            if kind == "add":
                _add(engine, payload, items)
            else:
                output = engine.abort(payload)
                if output is not None:
                    items.append((payload, output))
        if engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except Exception as exc:  # the engine is dead: its requests fail, the loop ends
                failed = list(engine.requests)
                logger.exception("an engine step failed; failing requests %s", failed)
                message = "an engine step failed; the replica's log has the details"
                if isinstance(exc, RankFailure):
                    message = exc.client_message()
                for request_id in failed:
                    with contextlib.suppress(Exception):  # give their blocks back if it can
                        engine.abort(request_id)
                    items.append((request_id, EngineError(message)))
                deliver(items)
                return
            else:
                items.extend((output.request_id, output) for output in outputs)
        if items:
            deliver(items)


def _add(engine: LLMEngine, request: EngineRequest, items: Items) -> None:
    try:
        engine.add_request(request)
    except RequestRejected as exc:
        items.append((request.request_id, exc))
        return
    except Exception:  # e.g. a malformed handed-over generator state: this request
        # fails, the loop (and every other request) goes on
        logger.exception("the engine could not add request %s", request.request_id)
        message = "the engine could not add the request; the replica's log has the details"
        items.append((request.request_id, EngineError(message)))
        return
    if request.imported is not None:
        # The engine keeps the KV payload only until it is written into the pool; the
        # request object lives as long as its stream and must not hold the host copy.
        request.imported.kv = None
