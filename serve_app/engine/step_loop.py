"""The engine's step loop, the same whether it runs on a thread or in a process of its own.

Messages in: ("add", EngineRequest), ("abort", request_id), ("stop", None). Out, once per loop
turn that produced anything: a list of (request id, RequestOutput or exception), the outputs of
one step plus what adding and aborting gave (a refusal, an aborted request's last output).
"""

from __future__ import annotations

from collections.abc import Callable

from serve_app.engine.errors import EngineError, RequestRejected
from serve_app.engine.inputs import EngineRequest
from serve_app.engine.llm_engine import LLMEngine

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
            except Exception as exc:  # a failed step fails its requests, not the server
                for request_id in list(engine.requests):
                    engine.abort(request_id)
                    items.append((request_id, EngineError(f"engine step failed: {exc!r}")))
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
    except Exception as exc:  # e.g. a malformed handed-over generator state: this request
        # fails, the loop (and every other request) goes on
        items.append((request.request_id, EngineError(f"the engine could not add it: {exc!r}")))
        return
    if request.imported is not None:
        # The engine keeps the KV payload only until it is written into the pool; the
        # request object lives as long as its stream and must not hold the host copy.
        request.imported.kv = None
