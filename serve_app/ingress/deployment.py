"""The `Ingress` deployment: a plain class whose ASGI app is built at replica start.

`serve.ingress()` without an app calls `__serve_build_asgi_app__` after the constructor, so the
FastAPI app is made per replica from the config and the handles it was bound with.
"""

from __future__ import annotations

from typing import Any

from serve_app.config import AppConfig
from serve_app.ingress.app import create_app
from serve_app.ingress.availability import Availability
from serve_app.ingress.backend import RayBackend
from serve_app.placement import bind_process
from serve_app.token_socket.inbox import TokenInbox


class Ingress:
    def __init__(
        self,
        tokenizer_pool: Any,
        replicas: dict[str, dict[str, Any]],
        config: AppConfig,
        replica_deployments: list[str],
        embedding: dict[str, Any] | None = None,
        stop_registry: Any = None,
        model_deployments: dict[str, list[str]] | None = None,
    ) -> None:
        """replicas: role ("colocated", or "prefill" and "decode") -> model name -> handle.
        embedding: embedding endpoint name -> handle. replica_deployments: the deployment
        names whose health is readiness (model and embedding replicas). stop_registry: the
        shared StopRegistry when there may be several ingress replicas (ingress/stops.py).
        model_deployments: model name -> its replica deployments (a request for a model none of
        whose replicas runs is refused at once: ingress/availability.py)."""
        from ray import serve

        bind_process(config.serving_cores())  # off the cores an engine process is bound to
        self.config = config
        self.backend = RayBackend(
            over_grpc(tokenizer_pool),
            {model: over_grpc(h) for model, h in replicas.get("colocated", {}).items()},
            serve.get_replica_context().app_name,
            prefill=replicas.get("prefill"),
            decode=replicas.get("decode"),
            embedding={name: over_grpc(h) for name, h in (embedding or {}).items()},
            stop_registry=None if stop_registry is None else over_grpc(stop_registry),
            token_inbox=_token_inbox(config),
        )
        self.backend.replica_deployments = list(replica_deployments)
        self.backend.availability = Availability(self.backend.app_name, model_deployments or {})

    def __del__(self) -> None:
        inbox = getattr(getattr(self, "backend", None), "token_inbox", None)
        if inbox is not None:
            inbox.close()

    def __serve_build_asgi_app__(self):
        return create_app(self.config, self.backend, echo_request_ids=False)  # Ray's proxy does


def over_grpc(handle: Any) -> Any:
    """The handle, its calls sent over Ray Serve's gRPC transport rather than as Ray actor
    tasks. The handles an app is bound with are made by whoever builds the app (`serve run`,
    `python -m serve_app`), with that process's default (actor tasks), so the ingress asks for
    gRPC itself: routing and submitting an actor task runs a lot of Python on the ingress's
    event loop for every call, where a gRPC call runs little (docs/performance.md, "What
    crosses and what attends").
    Not for the PD handles: a prefill's result and a decode request carry the KV's ObjectRef,
    which only Ray's own serialization passes on with its ownership."""
    return handle.options(_by_reference=False)


def _token_inbox(config: AppConfig) -> TokenInbox | None:
    """The ingress's token socket unless ServerConfig.tokenStream is "ray"; with "tcp" it also
    listens on this node's address as Ray knows it, for replicas on other nodes."""
    mode = config.ServerConfig.tokenStream
    if mode == "ray":
        return None
    import ray

    host = ray.util.get_node_ip_address() if mode == "tcp" else None
    return TokenInbox(ray.get_runtime_context().get_node_id(), tcp_host=host)
