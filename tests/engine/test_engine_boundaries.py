"""The engine stays free of the serving stack, and its config keeps MindIE's rules."""

import ast
import pathlib

import pytest

import serve_app.engine
from serve_app.engine import EngineConfig

FORBIDDEN = {"fastapi", "pydantic", "ray", "starlette", "xgrammar"}  # grammars: structured/


def test_engine_imports_no_serving_packages():
    root = pathlib.Path(serve_app.engine.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def test_overrides_accept_mindie_names_and_refuse_unknown_keys():
    config = EngineConfig.from_overrides("demo", maxIterTimes=64, cacheBlockSize=32)
    assert (config.max_iter_times, config.block_size) == (64, 32)
    with pytest.raises(TypeError, match="maxIterTime"):
        EngineConfig.from_overrides("demo", maxIterTime=64)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"max_prefill_tokens": 100, "max_input_token_len": 200}, "maxPrefillTokens"),
        ({"max_iter_times": 300, "max_seq_len": 200}, "maxIterTimes"),
        ({"max_prefill_batch_size": 10, "max_batch_size": 5}, "maxPrefillBatchSize"),
        ({"dtype": "int8"}, "dtype"),
        ({"block_size": 0}, "cacheBlockSize"),
    ],
)
def test_cross_checks_name_the_keys(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_overrides("demo", **overrides)
