"""Bad input at scale: schemathesis drives every route of the served OpenAPI document with
bodies, paths and queries generated from it, valid and invalid, against the real app (tokenizer
pool, engine) in process. Every answer must be a success or a client error in its family's error
shape; the only 5xx allowed is a generation that ran out of its own (fuzzed) timeout, which
MindIE and Databricks answer as 500 Incomplete Generation / 504.

SERVE_APP_FUZZ_EXAMPLES sets the cases per route (default 15 here; a few hundred for a long run).
"""

from __future__ import annotations

import os

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.ingress.conftest import in_family_envelope

EXAMPLES = int(os.environ.get("SERVE_APP_FUZZ_EXAMPLES", "15"))


def _operations(app) -> list:
    config = schemathesis.Config()
    config.projects.default.generation.update(database="none")
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=config)
    return [result.ok() for result in schema.get_all_operations()]


def _timed_out(status: int, body) -> bool:
    text = str(body)
    return (status == 500 and "timeout" in text.lower()) or (
        status == 504 and "DEADLINE_EXCEEDED" in text
    )


def _check(case) -> None:
    response = case.call(headers={"Accept": "application/json"})
    status = response.status_code
    content_type = (response.headers.get("content-type") or [""])[0]  # headers: name -> list
    body = response.json() if content_type.startswith("application/json") else response.text
    where = (case.method, case.formatted_path, case.body, case.query)
    if status >= 500:
        assert _timed_out(status, body), (*where, status, body)
    elif status >= 400:
        assert in_family_envelope(case.formatted_path, body), (*where, status, body)


def test_no_input_gets_a_server_error_or_a_foreign_error_shape(route_app):
    """Each route with valid and invalid inputs (schemathesis' strategies run by hypothesis;
    its pytest plugin's lazy fixtures do not work with this pytest)."""
    operations = _operations(route_app)
    assert len(operations) >= 25  # every family's routes are in the document
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                database=None,
                derandomize=True,
            )
            def run(case):
                _check(case)

            try:
                run()
            except Unsatisfiable:  # no invalid input exists (a GET without parameters)
                assert mode == GenerationMode.NEGATIVE, operation.label
