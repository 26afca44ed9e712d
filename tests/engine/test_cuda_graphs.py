"""Decode steps through captured graphs (cuda_graphs.DecodeGraphs). Off CUDA a "graph" is the
step run again on every replay, through the same static buffers, padding and scratch block, so
everything but the capture itself is checked here, with the CPU's paged decode kernel in the
Triton kernel's place (the same call)."""

from __future__ import annotations

import pytest
import torch

from serve_app.engine import LLM, SamplingParams
from serve_app.engine.backends.cpu import CPUBackend
from serve_app.engine.backends.cpu import kernels as cpu_kernels
from serve_app.engine.backends.cuda import CUDABackend
from serve_app.engine.backends.cuda import graphs as cuda_graphs
from serve_app.engine.backends.runner import ModelRunner
from serve_app.engine.config import EngineConfig
from tests.engine.engine_helpers import assert_idle, tokens

pytestmark = pytest.mark.usefixtures("one_tokenizer_per_model")

SETTINGS = dict(
    dtype="float32",
    max_batch_size=12,
    max_prefill_batch_size=12,
    max_seq_len=200,
    max_input_token_len=64,
    max_iter_times=100,
    max_prefill_tokens=1000,
    block_size=16,
    num_kv_blocks=64,
)


def prompts():
    return [[(i * 37 + j * 11) % 1000 + 5 for j in range(3 + 5 * i)] for i in range(11)]


def params():  # lengths that end at different steps: the batch shrinks through the sizes
    return [
        SamplingParams(max_tokens=10 + 7 * i, temperature=0, ignore_eos=True) for i in range(11)
    ]


@pytest.fixture(scope="module")
def eager():
    llm = LLM(model="demo-tiny", enforce_eager=True, **SETTINGS)
    assert llm.engine.runner.decode_graphs is None
    return tokens(llm.generate(prompts(), params()))


@pytest.fixture(scope="module")
def graphed():
    """An LLM whose runner captured its decode steps: CUDA graphs on CUDA (device auto), their
    eager stand-ins elsewhere. One for the module: each test drains it, and counts the replays
    and the KV blocks of its own requests only."""
    if not torch.cuda.is_available() and cpu_kernels.paged_decode_attention() is None:
        pytest.skip("the CPU kernels are not built (no C++ compiler)")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CPUBackend, "wants_decode_graphs", lambda self: True)
        return LLM(model="demo-tiny", **SETTINGS)


def test_batch_sizes():
    assert cuda_graphs.batch_sizes(1) == [1]
    assert cuda_graphs.batch_sizes(3) == [1, 2, 3]
    assert cuda_graphs.batch_sizes(12) == [1, 2, 4, 8, 12]
    assert cuda_graphs.batch_sizes(200)[-3:] == [184, 192, 200]
    assert cuda_graphs.batch_sizes(5000)[-1] == cuda_graphs.MAX_CAPTURED_BATCH


def test_decodes_replay_the_graphs_with_the_eager_tokens(graphed, eager):
    runner = graphed.engine.runner
    graphs = runner.decode_graphs
    assert graphs.sizes == [1, 2, 4, 8, 12] and set(graphs.graphs) == set(graphs.sizes)
    before = graphs.replays
    assert tokens(graphed.generate(prompts(), params())) == eager
    # one prefill step, then decodes only: every one of them a replay (11 padded to 12, ...)
    assert graphs.replays - before == max(p.max_tokens for p in params()) - 1
    assert_idle(graphed)


def test_padding_writes_only_the_scratch_block(graphed, monkeypatch):
    runner = graphed.engine.runner
    pool = graphed.engine.kv.pool
    used = set()  # the blocks handed to this test's requests

    def allocate(n, allocate=pool.allocate):
        blocks = allocate(n)
        used.update(blocks or ())
        return blocks

    monkeypatch.setattr(pool, "allocate", allocate)
    assert pool.num_blocks == runner.num_blocks == SETTINGS["num_kv_blocks"]
    scratch = runner.decode_graphs.scratch_block
    assert scratch == runner.num_blocks and runner.kv_caches[0][0].shape[0] == scratch + 1
    for k, v in runner.kv_caches:  # capture wrote there already: clear it to see it written
        k[scratch].zero_()
        v[scratch].zero_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    graphed.generate(prompts()[:3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(used) == 3  # three short prompts, a block each
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        for block in range(runner.num_blocks):
            if block not in used:
                assert k[block].equal(k0[block]) and v[block].equal(v0[block]), block
        assert k[scratch].any() and v[scratch].any()  # 3 rows padded to 4: the pad row wrote


def test_what_a_graph_does_not_cover_runs_eagerly(graphed):
    graphs = graphed.engine.runner.decode_graphs

    class Seq:
        def __init__(self, blocks):
            self.block_table = list(range(blocks))

    fits = [Seq(3)] * 12
    assert graphs.covers(fits, [1] * 12)
    assert not graphs.covers(fits[:2], [1, 5])  # a prompt chunk in the step
    assert not graphs.covers(fits + [Seq(3)], [1] * 13)  # more than the largest graph
    assert not graphs.covers([Seq(graphs.width + 1)], [1])  # a table wider than captured
    assert not graphs.covers([], [])
    # 13 requests: the first decode steps run eagerly (13 > 12), then replay as they finish
    more = [*prompts(), prompts()[0], prompts()[1]][:13]
    before = graphs.replays
    outs = graphed.generate(more, [*params(), *params()][:13])
    assert len(outs) == 13 and graphs.replays > before
    assert_idle(graphed)


def test_enforce_eager_captures_nothing(monkeypatch):
    config = EngineConfig(model="demo-tiny", enforce_eager=True, **SETTINGS)
    monkeypatch.setattr(ModelRunner, "_capture_decode_graphs", lambda self: pytest.fail())
    for kind in (CUDABackend, CPUBackend):  # what they read, without building a runner
        backend = kind.__new__(kind)
        backend.config, backend.decode_kernel = config, object()
        assert backend.wants_decode_graphs() is False
        backend.config = config.replace(enforce_eager=False)
        assert backend.wants_decode_graphs() is (kind is CUDABackend)


def test_the_engine_info_says_the_decode_steps_are_graphs(graphed, monkeypatch):
    from serve_app.engine.host.process import EngineInfo

    info = EngineInfo.of(graphed.engine)
    assert info.decode_graphs == 5
    assert info.placement() == ", decode steps as CUDA graphs (5 batch sizes)"
    monkeypatch.setattr(graphed.engine.runner, "decode_graphs", None)  # as without graphs
    assert EngineInfo.of(graphed.engine).decode_graphs == 0
    assert EngineInfo.of(graphed.engine).placement() == ""
