"""The FastAPI app: every API family's routes over one `Pipeline`, errors in their own envelopes.

`create_app(config, backend)` is used both by the Ray Serve `Ingress` deployment (backend = Ray
handles) and by tests (backend = plain objects in process).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.config import AppConfig
from serve_app.deployment_options import admission_limits
from serve_app.ingress import (
    admin_routes,
    databricks_routes,
    mindie_routes,
    openai_routes,
    tokenize_routes,
    triton_routes,
)
from serve_app.ingress.admission import Admission
from serve_app.ingress.api_keys import ApiKeys
from serve_app.ingress.backend import Backend
from serve_app.ingress.pipeline import Pipeline
from serve_app.ingress.request_body import RequestBody, error_response
from serve_app.ingress.request_ids import RequestIds
from serve_app.messages import ErrorKind
from serve_app.protocol.errors import APIError, family_for_path, from_validation_errors

# Routes are matched in this order, one after another, for every request: the busiest first
# (no two routes share a path and a method, so the order changes nothing else), since every
# route tried before the one that matches costs the request a match in Python
# (docs/performance.md, "The serving path's own lines and streams").
ROUTERS = (
    openai_routes.router,
    admin_routes.router,
    databricks_routes.router,
    mindie_routes.router,
    triton_routes.router,
    tokenize_routes.router,
)
_HTTP_KINDS = {
    401: ErrorKind.UNAUTHORIZED,
    404: ErrorKind.NOT_FOUND,
    413: ErrorKind.TOO_LARGE,
    503: ErrorKind.UNAVAILABLE,
}


def create_app(config: AppConfig, backend: Backend, echo_request_ids: bool = True) -> FastAPI:
    """echo_request_ids: add the X-Request-ID response header (off behind Ray Serve's proxy,
    which adds it itself)."""
    app = FastAPI(
        title="serve_app",
        description=(
            "LLM inference on Ascend NPU clusters: MindIE, OpenAI-style, Triton generate and "
            "Databricks Foundation Model APIs."
        ),
        version="0.1.0",
    )
    app.state.pipeline = Pipeline(config, backend)
    limit, queue = admission_limits(config)
    app.add_middleware(Admission, limit=limit, queue=queue)  # inside the body reader
    max_mb = config.ServerConfig.maxRequestLength
    app.add_middleware(RequestBody, max_bytes=max_mb * 1024 * 1024, max_mb=max_mb)
    keys = [key.get_secret_value() for key in config.ServerConfig.apiKeys]
    if keys:  # a request without a key is not even read
        app.add_middleware(ApiKeys, keys=keys)
    app.add_middleware(RequestIds, echo=echo_request_ids)  # the outermost: every answer has one

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _render(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = _HTTP_KINDS.get(exc.status_code)
        if kind is None:  # 405 and the like: keep the status, use the family's body
            error = APIError(ErrorKind.VALIDATION, str(exc.detail))
            body = error.body(family_for_path(request.url.path))
            return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
        return _render(request, APIError(kind, f"{exc.detail}: {request.url.path}"))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return _render(request, from_validation_errors(list(exc.errors())))

    for router in ROUTERS:
        app.include_router(router)
    return app


def _render(request: Request, error: APIError) -> JSONResponse:
    return error_response(error, request.url.path)
