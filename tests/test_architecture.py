"""The shape of the package, checked: no import cycle, layers that import only downwards, and
modules that stay small (docs/lifecycle.md explains the layers)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import serve_app

ROOT = pathlib.Path(serve_app.__file__).parent
README = ROOT.parent / "README.md"
MAX_LINES = 300


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """The serve_app modules `name` imports anywhere in its text (also inside functions), and
    the packages whose __init__ Python runs to import them."""
    path, found = MODULES[name], set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}".rstrip(".")
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            parts = target.split(".")
            found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    found.discard(name)
    return {m for m in found if m in MODULES and not name.startswith(m + ".")}


GRAPH = {name: _imports(name) for name in MODULES}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(GRAPH):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _reaches(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for nxt in GRAPH[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


@pytest.mark.parametrize(
    "layer, forbidden",
    [
        ("serve_app.engine", ("serve_app.protocol", "serve_app.ingress", "serve_app.replica",
                              "serve_app.disagg", "serve_app.tokenizer", "serve_app.config",
                              "serve_app.structured")),
        ("serve_app.structured", ("serve_app.protocol", "serve_app.ingress",
                                  "serve_app.replica", "serve_app.disagg",
                                  "serve_app.tokenizer", "serve_app.config")),
        ("serve_app.protocol", ("serve_app.disagg", "serve_app.replica", "serve_app.ingress")),
        ("serve_app.disagg", ("serve_app.protocol", "serve_app.ingress")),
        ("serve_app.tokenizer", ("serve_app.protocol", "serve_app.ingress", "serve_app.replica")),
        ("serve_app.config", ("serve_app.tokenizer", "serve_app.protocol", "serve_app.ingress",
                              "serve_app.replica", "serve_app.disagg")),
    ],
)  # fmt: skip
def test_layers_import_downwards(layer, forbidden):
    for name in [m for m in MODULES if m == layer or m.startswith(layer + ".")]:
        bad = sorted(m for m in _reaches(name) if m.startswith(forbidden))
        assert not bad, f"{name} imports {bad}"


def test_the_engine_core_imports_no_device_code_and_no_host():
    """serve_app/engine/ holds what a step is; backends/ is what touches a device (the model
    runner, one backend per device); host/ is where the step loop runs (a thread, a process).
    The core imports neither, but for the engine that wires a runner (llm_engine) and the
    package's own names (AsyncEngine is the host's); the backends import no host
    (docs/engine.md)."""
    rooms = ("serve_app.engine.backends", "serve_app.engine.host")
    wiring = {"serve_app.engine", "serve_app.engine.llm_engine"}
    for name in MODULES:
        if not name.startswith("serve_app.engine"):
            continue
        if name.startswith(rooms[0]):
            bad = sorted(m for m in GRAPH[name] if m.startswith(rooms[1]))
        elif name.startswith(rooms[1]) or name in wiring:
            continue
        else:
            bad = sorted(m for m in GRAPH[name] if m.startswith(rooms))
        assert not bad, f"{name} imports {bad}"


def test_modules_stay_small_or_the_readme_says_why():
    readme = README.read_text(encoding="utf-8")
    for path in MODULES.values():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        relative = str(path.relative_to(ROOT.parent))
        if lines > MAX_LINES:
            assert re.search(re.escape(relative) + r"`? \(", readme), (
                f"{relative} has {lines} lines (> {MAX_LINES}); split it or say why in README.md"
            )


def test_kernel_sources_stay_small():
    """The C++ kernels are held to the Python's cap, with no way out: a source past it is split
    by concern (csrc/streamed_gemm.cpp's parts, say)."""
    csrc = sorted((ROOT / "engine" / "backends" / "cpu" / "csrc").glob("*.[ch]*"))
    assert csrc
    for path in csrc:
        lines = len(path.read_text(encoding="utf-8").splitlines())
        assert lines <= MAX_LINES, f"{path.name} has {lines} lines (> {MAX_LINES}): split it"


def test_processes_without_a_model_do_not_import_the_model_code():
    # the ingress and the tokenizer pool start in every app and every scale-out, and a model
    # replica whose step loop runs in a child process (engineProcess, the default) holds no
    # model itself: importing transformers' modeling code with the engine's runner cost each
    # ~5 s of CPU on 2 cores; the ingress does not even need torch (~2 s more). Nor does the
    # app's builder, which imports every replica's class: `python -m serve_app` waits for it
    # while nothing else runs (~1.2 s)
    import subprocess
    import sys

    code = (
        "import sys, serve_app.ingress.deployment, serve_app.tokenizer.pool, serve_app.app\n"
        "import serve_app.replica.model_replica, serve_app.replica.embedding_replica\n"
        "print('torch' in sys.modules)\n"
        "heavy = ['serve_app.engine.backends.runner', 'transformers.modeling_utils']\n"
        "print([m for m in heavy if m in sys.modules])\n"
        "from serve_app.engine import LLM, SamplingParams\n"  # still there on first use
        "from serve_app.embedding import Encoder\n"
        "print(LLM.__module__, SamplingParams.__module__, Encoder.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:3] == [
        "False",
        "[]",
        "serve_app.engine.llm serve_app.engine.params serve_app.embedding.encoder",
    ]


def test_requires_python_is_what_the_code_needs():
    """pyproject's requires-python and ruff's target are the oldest Python the code's syntax and
    standard library need (vermin reads every file of the package, the bench and the tests)."""
    import subprocess
    import sys

    pyproject = (ROOT.parent / "pyproject.toml").read_text(encoding="utf-8")
    declared = re.search(r'^requires-python = "(.*)"$', pyproject, re.M).group(1)
    target = re.search(r'^target-version = "(.*)"$', pyproject, re.M).group(1)
    vermin = "import sys, vermin; sys.exit(vermin.main())"
    found = subprocess.run(
        [sys.executable, "-c", vermin, "--no-tips", "--eval-annotations", "--no-parse-comments",
         "serve_app", "bench", "tests"],
        cwd=ROOT.parent, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    minimum = re.search(r"Minimum required versions: (3\.\d+)", found.stdout)
    assert minimum, found.stdout + found.stderr
    major, minor = minimum.group(1).split(".")
    assert declared == f">={major}.{minor}", (declared, minimum.group(1))
    assert target == f"py{major}{minor}"
