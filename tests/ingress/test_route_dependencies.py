"""Per-request costs of the routes: no endpoint or dependency is a plain function (FastAPI runs
those in a worker thread, a thread hop and at times a new thread for every request), and the
busiest routes are matched first (every request is matched against the routes in order)."""

from __future__ import annotations

import inspect

from fastapi.routing import APIRoute

from serve_app.ingress.app import ROUTERS


def _calls(dependant):
    for dependency in dependant.dependencies:
        yield dependency.call
        yield from _calls(dependency)


def test_every_endpoint_and_dependency_is_a_coroutine_function():
    routes = [r for router in ROUTERS for r in router.routes if isinstance(r, APIRoute)]
    assert len(routes) > 10
    plain = [
        f"{route.path}: {getattr(call, '__qualname__', call)}"
        for route in routes
        for call in [route.endpoint, *_calls(route.dependant)]
        if not inspect.iscoroutinefunction(call)
    ]
    assert plain == []


def test_the_generation_routes_are_matched_first():
    paths = [r.path for router in ROUTERS for r in router.routes if isinstance(r, APIRoute)]
    first = paths.index("/v1/completions"), paths.index("/v1/chat/completions")
    others = [i for i, path in enumerate(paths) if not path.startswith("/v1/")]
    assert max(first) < min(others)
    assert len(set(paths)) == len(paths)  # no path served twice: the order decides nothing else
