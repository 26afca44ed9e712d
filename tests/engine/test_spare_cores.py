"""Helper threads on spare cores (engineSpareCpus, csrc/spare_cores.h): a GEMM, a decode
attention or a greedy argmax shared with them gives exactly the caller's own result, whoever
computes which chunk, also when the caller takes chunks back from late helpers; the engine
process starts them at idle priority."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os

import pytest
import torch

from serve_app.engine import EngineConfig, SamplingParams
from serve_app.engine.backends.cpu import gemm as cpu_gemm
from serve_app.engine.backends.cpu import kernels as cpu_kernels
from serve_app.engine.backends.cpu import spare_cores
from serve_app.engine.backends.cpu.spare_cores import CHUNK_KEYS, lend_spare_cores, shared_chunks
from serve_app.engine.host.async_engine import AsyncEngine
from serve_app.engine.inputs import EngineRequest

use_spare_cpus = cpu_kernels.op("use_spare_cpus")
stats = cpu_kernels.op("spare_cores_stats")
pytestmark = [
    pytest.mark.skipif(
        cpu_kernels.op("streamed_linear") is None,
        reason="the streamed GEMM (the kernel helpers share) is built for AVX-512 and AVX2 only",
    ),
    pytest.mark.usefixtures("one_tokenizer_per_model"),
]
CORE = min(os.sched_getaffinity(0))
CONFIG = EngineConfig(
    model="demo-tiny", dtype="float32", max_seq_len=256, max_input_token_len=128,
    max_iter_times=64, max_prefill_tokens=256, block_size=16, num_kv_blocks=64,
)  # fmt: skip
PROCESS = CONFIG.replace(engine_process=True)


@pytest.fixture
def helpers():
    """Start helpers with `start(helper_delay_us, team_delay_us)`; stopped after the test."""

    def start(helper_delay_us=0, team_delay_us=0):
        assert use_spare_cpus([CORE], helper_delay_us, team_delay_us) == 1

    yield start
    assert use_spare_cpus([]) == 0


def _gemm_cases():
    """GEMM calls, each as a function of nothing: each dtype, one row and many (prefill
    slices), with and without a bias, each epilogue, wide enough to make many chunks; and a
    GEMM of few blocks and many rows, whose last blocks are cut in rows."""
    torch.manual_seed(0)
    shapes = ((9005, 64, (1, 100)), (500, 512, (300,)))  # last blocks of 13 and 20 columns
    for dtype in (torch.float32, torch.bfloat16):
        for n, k, row_counts in shapes:
            weight = torch.randn(n, k).to(dtype)
            for rows in row_counts:
                for bias in (None, torch.randn(n).to(dtype)):
                    layer = cpu_gemm.StreamedLinear(weight, bias)
                    x = torch.randn(rows, k).to(dtype)
                    other = torch.randn(rows, n).to(dtype)
                    for epilogue in (0, 1, 2, 3):
                        yield functools.partial(
                            layer.kernel, x, layer.packed, layer.out_features, layer.bias,
                            other if epilogue else None, epilogue,
                        )  # fmt: skip


def _attention_cases():
    """Decode attention calls: each dtype, long contexts (many chunks), grouped queries with
    a vectorised head size and with another."""
    torch.manual_seed(0)
    attention = cpu_kernels.op("paged_decode_attention")
    for dtype in (torch.float32, torch.bfloat16):
        for heads, kv_heads, head_dim in ((8, 2, 64), (6, 2, 80)):
            lens = torch.randint(1, 1500, (24,))
            width = -(-1500 // 16)
            k, v = (torch.randn(24 * width, 16, kv_heads, head_dim).to(dtype) for _ in "kv")
            tables = torch.randperm(24 * width).view(24, width)
            q = torch.randn(24, heads, head_dim).to(dtype)
            yield functools.partial(attention, q, k, v, tables, lens, head_dim**-0.5)


def _argmax_cases():
    """Greedy sampling's argmax over a step's logits: each dtype, a vocabulary-wide row per
    sequence, ties (the first maximum wins) and a NaN."""
    torch.manual_seed(0)
    argmax = cpu_kernels.op("argmax_rows")
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(96, 151936).to(dtype)
        logits[3, [7, 90000]] = 100.0
        logits[5, 1234] = float("nan")
        yield functools.partial(argmax, logits)


CASES = {"gemm": _gemm_cases, "attention": _attention_cases, "argmax": _argmax_cases}


def _run(cases):
    with torch.inference_mode():
        return [case() for case in cases]


@contextlib.contextmanager
def _helper_on_core(helper_delay_us=0, team_delay_us=0, *, spin_us, part_delay_us=0):
    """A helper on CORE (arguments as use_spare_cpus takes them) for the block's length."""
    use_spare_cpus([CORE], helper_delay_us, team_delay_us, spin_us, part_delay_us)
    try:
        yield
    finally:
        use_spare_cpus([])


def _exactly_the_callers_own(kernel, delays, counter, part_delay_us=0):
    """Runs `kernel`'s cases with helpers (delays as use_spare_cpus takes them) until
    stats()[counter] moved, at most 20 times, each time checking every result bit for bit
    against the caller's own; how much it moved. (A helper at idle priority may get no time at
    all while another process keeps its core busy, or find each job only once the caller has
    claimed every chunk: the rounds give it more chances, and where it claimed no chunk in any
    of them the test skips, as _jobs_found does. Here it
    sleeps between jobs instead of spinning: the scheduler gives a woken thread a turn on a
    busy core sooner than one that never slept.)"""
    cases = list(CASES[kernel]())
    alone = _run(cases)
    before = stats()
    for _ in range(20):
        with _helper_on_core(*delays, spin_us=0, part_delay_us=part_delay_us):
            shared = _run(cases)
        for got, expect in zip(shared, alone, strict=True):
            assert torch.equal(got, expect)  # the same sums, in the same order, bit for bit
        if stats()[counter] > before[counter]:
            break
    after = stats()
    if after[1:3] == before[1:3]:  # a claimed chunk ends as the helper's or taken back
        pytest.skip(f"core {CORE} was too busy for the helper to claim any chunk")
    return after[counter] - before[counter]


@pytest.mark.parametrize("kernel", CASES)
def test_helpers_compute_chunks_in_place_of_the_caller(kernel):
    # the caller's thread sleeps before each chunk: helpers surely get some
    assert _exactly_the_callers_own(kernel, (0, 2000), counter=1) > 0


@pytest.mark.parametrize("kernel", CASES)
def test_the_caller_takes_back_the_chunks_of_late_helpers(kernel):
    # helpers sleep 50 ms before each chunk they claim: the caller redoes it and returns, the
    # helper's result is dropped (and the inputs it still reads stay alive until then); the
    # caller's threads sleep 0.5 ms before each chunk, so that a helper woken by the job finds
    # a chunk left to claim (a short job's chunks were otherwise often all the caller's)
    assert _exactly_the_callers_own(kernel, (50_000, 500), counter=2) > 0


def test_the_caller_takes_back_only_the_parts_a_late_helper_has_not_placed():
    # A decode GEMM's chunk goes into place in parts: a helper that stalls after the first part
    # of its chunk (50 ms before each later part) has that part placed when the caller takes the
    # chunk back, and the caller computes only the rest (the result bit for bit its own). Without
    # the parts the caller recomputed the whole chunk, and the helper went on computing a chunk
    # no longer its own while the next job waited for it: ~10 us of each ~120 us decode-step
    # GEMM of the demo at 32 rows.
    kept = _exactly_the_callers_own("gemm", (0, 500), counter=5, part_delay_us=50_000)
    assert kept > 0


@pytest.fixture
def one_thread_off_the_helpers_core():
    """The test's thread on one torch thread and off CORE (the helper's), so that the helper
    there gets the time that its core has idle; restored after the test."""
    others = os.sched_getaffinity(0) - {CORE}
    if not others:
        pytest.skip("needs a core besides the helper's")
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    torch.set_num_threads(1)
    os.sched_setaffinity(0, others)
    yield
    os.sched_setaffinity(0, affinity)
    torch.set_num_threads(threads)


def _jobs_found(spin_us):
    """Runs 200 shared GEMMs back to back with a helper that waits `spin_us` for the next job
    before it sleeps; how many jobs it found awake and how many only after sleeping, in the
    first of up to 10 rounds where it joined 20 of them or more. At idle priority a helper
    gets no time while another process keeps its core busy (then this skips)."""
    layer = cpu_gemm.StreamedLinear(torch.randn(8192, 512))  # ~1 ms at 32 rows: a few chunks
    x = torch.randn(32, 512)
    for _ in range(10):
        before = stats()
        with _helper_on_core(spin_us=spin_us), torch.inference_mode():
            for _ in range(200):
                layer(x)
        awake, slept = (after - was for after, was in zip(stats()[3:5], before[3:5], strict=True))
        if awake + slept >= 20:
            return awake, slept
    pytest.skip(f"core {CORE} was too busy for the helper to join the jobs")


def test_a_helper_waits_awake_for_the_next_job_of_a_step(one_thread_off_the_helpers_core):
    # a step's jobs follow each other faster than a sleeping thread wakes: a helper spins a
    # while after each job and finds most next ones awake; without the spin it sleeps after
    # most jobs. Compared as shares, not counts, and with a margin: on a busy core a helper
    # preempted before it could sleep may still find the next job awake, and one kept off its
    # core for longer than its spin (it runs at idle priority) sleeps for all its spinning.
    awake, slept = _jobs_found(spin_us=1_000_000)
    assert awake > 3 * slept
    awake_without, slept_without = _jobs_found(spin_us=0)
    assert slept_without > 0
    assert awake * slept_without > 2 * awake_without * slept  # the odds at least doubled


def test_a_gemm_too_small_to_share_is_the_callers(helpers):
    helpers()
    before = stats()
    layer = cpu_gemm.StreamedLinear(torch.randn(32, 64))  # one block: one chunk
    with torch.inference_mode():
        layer(torch.randn(3, 64))
    assert stats() == before


speed = cpu_kernels.op("streamed_gemm_speed")


@pytest.fixture(autouse=True)
def _measured_speed_kept():
    """The measured speed factors are the process's: a test that sets them puts them back."""
    kept = speed()
    yield
    speed(kept)


def _chunks_of_one_call(layer, x, factors):
    """How many chunks one shared call of `layer` on `x` was cut into, with the measured speed
    factors set to `factors` first, and its result."""
    speed(factors)
    before = stats()
    with torch.inference_mode():
        out = layer(x)
    team, helper, taken = (after - was for after, was in zip(stats()[:3], before[:3], strict=True))
    return team + helper + taken, out  # a chunk ends as the caller's, a helper's or taken back


def test_a_gemms_chunks_grow_with_the_measured_speed(helpers):
    # 32 rows x K 512 in float32: compute-bound in the model (a block ~16 us), 1024 blocks
    helpers()
    torch.manual_seed(0)
    layer, x = cpu_gemm.StreamedLinear(torch.randn(32768, 512)), torch.randn(32, 512)
    alone, expect = _chunks_of_one_call(layer, x, [1.0, 1.0])
    faster, got = _chunks_of_one_call(layer, x, [1.0, 4.0])
    assert faster < alone / 2  # ~0.2 ms of work per chunk at the speed measured
    assert torch.equal(got, expect)  # whoever computes which blocks: the same sums
    memory_bound, _ = _chunks_of_one_call(layer, x, [4.0, 1.0])  # the other factor: no change
    assert memory_bound == alone


def test_a_small_gemm_keeps_eight_chunks_however_fast_the_machine(helpers):
    helpers()
    layer, x = cpu_gemm.StreamedLinear(torch.randn(2816, 512)), torch.randn(32, 512)  # 88 blocks
    chunks, _ = _chunks_of_one_call(layer, x, [64.0, 64.0])
    assert chunks >= 8


def test_a_decode_gemms_last_pieces_shrink_to_single_blocks(helpers):
    # 88 blocks at 32 rows, float32 (the model's ~16 us a block, 12 blocks a chunk): 6 chunks
    # (the last of 4 blocks), then the last 24 blocks in pieces of a quarter of what is left:
    # 6, 5, 4, 3, 2, 1, 1, 1, 1. Whichever thread takes the last piece, the other waits a
    # block's time at most (in quarters of a chunk, 8 pieces of 3 blocks: the caller waited
    # ~14 us of each ~150 us decode GEMM of the demo for the helper's last piece).
    torch.manual_seed(0)
    layer, x = cpu_gemm.StreamedLinear(torch.randn(2816, 512)), torch.randn(32, 512)
    with torch.inference_mode():
        expect = layer(x)
    helpers()
    chunks, got = _chunks_of_one_call(layer, x, [1.0, 1.0])
    assert chunks == 6 + 9
    assert torch.equal(got, expect)


def test_a_gemm_of_many_rows_is_cut_in_slices_of_rows_with_every_block(helpers):
    # 16 blocks x 1000 rows (21 slices of at most 48): at most 2 blocks of all the rows a chunk
    # (at least 8 chunks), the same work as 2 slices with every block, so 9 chunks of 2 slices
    # (the last of one), then the last two chunks' worth, 4 slices, each in 2 pieces of 8
    # blocks; at 1 block a chunk, 1 slice: 19 chunks, then the last 2 slices in 4 pieces each.
    # A chunk's rows stay in the cache while the weight streams by (cut in blocks, each chunk
    # read every row again). Whoever computes which piece, the result is the caller's own.
    torch.manual_seed(0)
    layer, x = cpu_gemm.StreamedLinear(torch.randn(500, 512)), torch.randn(1000, 512)
    with torch.inference_mode():
        expect = layer(x)  # no helpers yet: the caller's own
    helpers()
    for factors, pieces in (([64.0, 64.0], 9 + 4 * 2), ([0.25, 0.25], 19 + 2 * 4)):
        chunks, got = _chunks_of_one_call(layer, x, factors)
        assert chunks == pieces
        assert torch.equal(got, expect)


def test_the_callers_chunks_measure_the_speed(helpers):
    helpers()
    layer, x = cpu_gemm.StreamedLinear(torch.randn(32768, 512)), torch.randn(32, 512)
    speed([1.0, 1.0])
    with torch.inference_mode():
        for _ in range(20):
            layer(x)
    memory, compute = speed()
    assert memory == 1.0  # no memory-bound GEMM ran
    assert compute != 1.0 and 0.25 <= compute <= 64.0
    with pytest.raises(RuntimeError, match="> 0"):
        speed([0.0, 1.0])


def test_helpers_run_at_idle_priority_on_their_core(helpers):
    own = set(os.listdir("/proc/self/task"))
    helpers()
    new = [int(t) for t in set(os.listdir("/proc/self/task")) - own]
    assert any(
        os.sched_getscheduler(t) == os.SCHED_IDLE and os.sched_getaffinity(t) == {CORE} for t in new
    )


def test_a_core_that_is_not_there_is_named():
    with pytest.raises(RuntimeError, match="core 4096"):
        use_spare_cpus([4096])
    assert use_spare_cpus([]) == 0
    assert lend_spare_cores([]) == 0


def test_an_engine_refused_its_helpers_runs_without_them(caplog):
    # lend_spare_cores' callers checked the cores first; a refusal left (a container that
    # forbids the idle priority, say) costs the helpers, not the engine
    assert lend_spare_cores([4096]) == 0
    assert "spare cores 4096 not lent" in caplog.text and "core 4096" in caplog.text
    assert use_spare_cpus([]) == 0


def test_the_engine_process_lends_its_gemms_the_spare_cores():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores: one for the engine, one spare")
    engine = AsyncEngine(PROCESS.replace(engine_cpus=(cores[1],), engine_spare_cpus=(cores[0],)))
    try:
        assert engine.info.cpus == (cores[1],) and engine.info.spare_cpus == (cores[0],)
        pid = engine._host.pid
        # one helper at idle priority on the spare core (the KV cache's committing thread,
        # backends/cpu/commit.py, is at idle priority too, on the engine's core)
        helpers = [
            int(t) for t in os.listdir(f"/proc/{pid}/task")
            if os.sched_getscheduler(int(t)) == os.SCHED_IDLE
            and os.sched_getaffinity(int(t)) == {cores[0]}
        ]  # fmt: skip
        assert len(helpers) == 1
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

        async def tokens():
            out = []
            async for output in engine.generate(EngineRequest("lent", list(range(40)), greedy)):
                out += output.outputs[0].new_token_ids
            return out

        assert len(asyncio.run(tokens())) == 12
        # its stats (as of its last step) say where the shared kernels ran
        chunks = {key: engine.stats()[key] for key in CHUNK_KEYS}
        assert chunks["cpu_chunks_step_loop"] + chunks["cpu_chunks_helpers"] > 0
        assert chunks["cpu_chunks_taken_back"] >= 0
    finally:
        engine.shutdown()


def test_spare_cores_need_the_engine_process_and_are_not_its_own():
    with pytest.raises(ValueError, match="engineSpareCpus needs engineProcess"):
        CONFIG.replace(engine_spare_cpus=(0,))
    with pytest.raises(ValueError, match="engineSpareCpus 1 are engineCpus too"):
        PROCESS.replace(engine_cpus=(1,), engine_spare_cpus=(0, 1))


def test_an_engine_without_helpers_reports_no_chunks(monkeypatch):
    monkeypatch.setattr(spare_cores, "_chunk_counts", None)
    assert shared_chunks() == {}
    engine = AsyncEngine(CONFIG)  # on a thread: never lent helpers
    try:
        assert not set(CHUNK_KEYS) & set(engine.stats())
    finally:
        engine.shutdown()


def test_lent_helpers_count_the_chunks_of_a_shared_gemm(monkeypatch):
    monkeypatch.setattr(spare_cores, "_chunk_counts", None)
    try:
        assert lend_spare_cores([CORE]) == 1
        before = shared_chunks()
        layer = cpu_gemm.StreamedLinear(torch.randn(9005, 64))
        layer(torch.randn(4, 64))
        after = shared_chunks()
        assert set(after) == set(CHUNK_KEYS)
        shared = sum(after[k] - before[k] for k in CHUNK_KEYS[:2])
        assert shared > 1  # the GEMM was cut in chunks, each counted once where it ran
    finally:
        assert use_spare_cpus([]) == 0
