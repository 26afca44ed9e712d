"""Shared fixtures: the demo models are built once per machine into the cache folder.

`make test` runs pytest on two workers (pytest-xdist `-n 2`), a test file at a time per worker, so
that module fixtures are built once and a file's tests run in their order. The tests that start
Ray come first, in two units, one on each worker: the commands' own Ray instances
(tests/cluster/test_cli.py: `ray start`, `serve run`, `make serve`), and everything on the Serve
test cluster or a local Ray in the same process (tests/serve/, the object-store connector), in
RAY_ORDER. Both mostly wait (Ray start-ups, app deploys, replicas replaced, Serve draining) and
use the CPU in bursts, so they share the two cores well; a third worker to fill their waits
lowered the idle time but not the run's (measured), at more CPU. After its Ray unit a worker
runs the CPU-bound engine and route tests, the heaviest files first, at a lower CPU priority
(nice 10) so that they take only the time the other Ray unit leaves, and with torch on one
thread. The tests that find processes tell the units apart by TEST_RUN_ENV, which each worker
gives what it starts.
"""

import contextlib
import os
import signal
import time

import pytest
import torch

from tests.processes import TEST_RUN_ENV, started_by_this_run

# Test files (paths from the repository root) that start or join a Ray instance, and the work
# unit of each: the CLI's commands start Ray instances of their own (each its own ports and
# folders), the rest share one Ray in the worker's process.
RAY_UNITS = {
    "tests/cluster/test_cli.py": "ray-cli",
    "tests/serve/": "ray",
    "tests/disagg/test_connector.py": "ray",
}
RAY_TESTS = tuple(RAY_UNITS)
# The "ray" unit's files in this order (the others after them): test_faults.py breaks the app
# that test_serve_app.py deployed and leaves running for it (one deploy for both); the connector
# then uses the serve tests' cluster (started in this process) rather than a Ray of its own;
# test_world_size.py tests the app test_real_model.py deployed (SmolLM2 and the split demo).
RAY_ORDER = (
    "tests/serve/test_serve_app.py", "tests/serve/test_faults.py", "tests/disagg/test_connector.py",
    "tests/serve/test_real_model.py", "tests/serve/test_world_size.py",
)  # fmt: skip
# The heaviest test files without Ray (model parity on whole models, engine processes, the
# benches' own servers): left out of `make test-fast` with RAY_TESTS (marker `slow`).
SLOW_TESTS = (
    "tests/engine/test_engine.py", "tests/engine/test_engine_process.py",
    "tests/engine/test_npu_attention.py", "tests/engine/test_smollm2.py",
    "tests/engine/test_spare_cores.py", "tests/engine/test_cpu_layers.py",
    "tests/engine/test_cpu_gemm.py", "tests/engine/test_kv_transfer.py",
    "tests/engine/test_cuda_graphs.py", "tests/structured/test_structured_engine.py",
    "tests/engine/test_tensor_parallel.py",
    "tests/structured/test_structured_smollm2.py", "tests/models/", "tests/bench/",
    "tests/ingress/test_fuzz.py", "tests/engine/test_instruction_sets.py",
)  # fmt: skip


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's work units for `-n N` (its default `--dist load`; another --dist is left alone):
    one per test file, the Ray tests in their RAY_UNITS, handed out first (one to each worker),
    then the SLOW_TESTS files."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    units = sorted(set(RAY_UNITS.values()))

    class ByFileRayTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            unit = [u for prefix, u in RAY_UNITS.items() if path.startswith(prefix)]
            return unit[0] if unit else path

        def _assign_work_unit(self, node) -> None:
            # the heaviest files next, so that no long one is left to run alone at the end
            for unit in [u for u in self.workqueue if u.startswith(SLOW_TESTS)][::-1]:
                self.workqueue.move_to_end(unit, last=False)
            for unit in units:
                if unit in self.workqueue:
                    self.workqueue.move_to_end(unit, last=False)
            super()._assign_work_unit(node)

        def remove_node(self, node) -> str | None:
            # as xdist's own, but the test a crashed worker was running is reported failed
            # and not handed out again: xdist's put it back in its unit, so each replacement
            # worker ran it again (and crashed again, where the test itself crashes), and once
            # it passed the run waited forever for a result it had already counted
            workload = self.assigned_work.pop(node)
            pending = [(s, test) for s, unit in workload.items() for test, done in unit.items()
                       if not done]  # fmt: skip
            if not pending:
                return None
            scope, crashed = pending[0]
            workload[scope][crashed] = True
            self.workqueue.update({s: u for s, u in workload.items() if not all(u.values())})
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

    return ByFileRayTogether(config, log)


# At the session's end no process the tests started (TEST_RUN_ENV) may be left.
LEFTOVER_WAIT_S = 30  # Ray's workers exit a few seconds after the cluster is shut down


def pytest_configure(config):
    os.environ[TEST_RUN_ENV] = f"{os.getpid()}-{time.time_ns()}"


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_session():
    """Torn down after every other session fixture: what the tests started must be gone. What
    is left is killed, and the session fails naming it."""
    yield
    if not os.path.isdir("/proc"):
        return
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while (left := started_by_this_run()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not left, "processes started by the tests outlived the session (killed now):\n" + (
        "\n".join(f"{pid}: {command[:200]}" for pid, command in sorted(left.items()))
    )


# pytest-timeout's limit (pyproject: 120 s a test) for the tests that start Ray or a server: the
# first test of a module also waits for its app to deploy, and replicas are replaced in them.
RAY_TEST_TIMEOUT_S = 600


def pytest_collection_modifyitems(config, items):
    def ray_rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return RAY_ORDER.index(path) if path in RAY_ORDER else len(RAY_ORDER)

    ray = sorted((item for item in items if item.nodeid.startswith(RAY_TESTS)), key=ray_rank)
    items[:] = ray + [item for item in items if not item.nodeid.startswith(RAY_TESTS)]
    for item in items:
        if item.nodeid.startswith(RAY_TESTS):
            item.add_marker(pytest.mark.ray)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(RAY_TEST_TIMEOUT_S))
        elif item.nodeid.startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)


def _lower_priority() -> None:
    """Nice 10 for every thread of this process (Linux sets niceness per thread) and what it
    starts from now on."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), 10)
        except OSError:  # a thread that ended meanwhile
            pass


def pytest_runtest_setup(item):
    # an xdist worker: once it runs a test that is not a Ray one (the Ray unit comes first)
    if "PYTEST_XDIST_WORKER" in os.environ and not item.nodeid.startswith(RAY_TESTS):
        if os.getpriority(os.PRIO_PROCESS, 0) < 10 and os.path.isdir("/proc/self/task"):
            _lower_priority()
            # and torch on one thread (the engine processes it starts inherit that): the other
            # worker keeps the second core busy, and torch's threads waiting for a core burnt
            # more CPU than the work itself
            torch.set_num_threads(1)


@pytest.fixture(scope="session")
def demo_path():
    from serve_app.models.demo import ensure_demo_model

    return ensure_demo_model("demo")


@pytest.fixture(scope="session")
def hf_demo(demo_path):
    """transformers' own model on the same weights: the reference we must match."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def prompts():
    """Prompts of many lengths, random ids from the ordinary vocabulary."""
    generator = torch.Generator().manual_seed(1234)
    lengths = [1, 2, 7, 16, 31, 64, 100, 150, 5]
    return [torch.randint(0, 151643, (n,), generator=generator).tolist() for n in lengths]


def transformers_greedy(model, prompts, max_new_tokens=16, ignore_eos=True):
    """transformers' greedy continuation of each prompt, with the log-probability of each
    chosen token: (tokens, logprobs). ignore_eos: exactly max_new_tokens each, all prompts in one
    left-padded, masked `generate` (one forward pass per new token for all of them: the same
    tokens as one prompt at a time, log-probabilities within ~1e-5); else one prompt at a time,
    each stopping at the model's EOS, as ours do."""
    if ignore_eos:
        width = max(map(len, prompts))
        batches = [
            (
                [[0] * (width - len(p)) + list(p) for p in prompts],
                [[0] * (width - len(p)) + [1] * len(p) for p in prompts],
            )
        ]
    else:
        batches = [([list(p)], [[1] * len(p)]) for p in prompts]
    tokens, logprobs = [], []
    with torch.inference_mode():
        for ids, mask in batches:
            out = model.generate(
                torch.tensor(ids),
                attention_mask=torch.tensor(mask),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens if ignore_eos else None,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            chosen = out.sequences[:, len(ids[0]) :]
            steps = torch.stack(out.logits, 1).float().log_softmax(-1)
            tokens += chosen.tolist()
            logprobs += steps.gather(2, chosen[:, :, None])[:, :, 0].tolist()
    return tokens, logprobs


@pytest.fixture(scope="module")
def one_tokenizer_per_model():
    """For a module whose engines, replicas and pools only read their tokenizer: each model
    folder's is loaded once (by serve_app's own loader) and shared by all of them. Loading one
    parses a 150k-token vocabulary and its merges, most of the start of an engine on a demo
    model. Use it as `pytestmark = pytest.mark.usefixtures("one_tokenizer_per_model")`."""
    from serve_app.engine.backends import runner as model_runner
    from serve_app.models import loader
    from serve_app.tokenizer import pool

    loaded, load = {}, loader.load_tokenizer

    def load_once(path):
        if str(path) not in loaded:
            loaded[str(path)] = load(path)
        return loaded[str(path)]

    with pytest.MonkeyPatch.context() as patch:
        for module in (loader, model_runner, pool):  # the names each of them calls it by
            patch.setattr(module, "load_tokenizer", load_once)
        yield


@pytest.fixture(scope="session")
def hf_greedy(hf_demo, prompts):
    """transformers' greedy continuation of each prompt (16 tokens, EOS ignored) and the
    log-probability of each chosen token: the demo model's argmax is decisive by design, so
    parity of the log-probabilities is what shows that every cached position was attended."""
    return transformers_greedy(hf_demo, prompts)


@pytest.fixture(scope="session")
def greedy_reference(hf_greedy):
    return hf_greedy[0]


@pytest.fixture(scope="session")
def smollm2_path():
    """The built-in SmolLM2-135M-Instruct folder (`make install` converts it; else now)."""
    from serve_app.models import smollm2

    return smollm2.ensure()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy_of():
    """transformers_greedy, for test modules with prompts and models of their own."""
    return transformers_greedy
