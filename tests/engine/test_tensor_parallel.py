"""Tensor parallelism on CPU (gloo): a model split over 2 or 3 ranks gives the same tokens and the
same log-probabilities as on one, through chunked prefill, prefix reuse, preemption, beam search
and seeded sampling; the PD hand-off moves every KV head between engines of different world
sizes; a model that does not split is refused naming worldSize; a dead rank fails the next step
at once; no rank outlives its engine."""

import os
import signal
import time

import pytest
import torch
from engine_helpers import assert_idle, run_to_end, tokens
from transformers import LlamaConfig

from serve_app.engine import EngineRequest, SamplingParams
from serve_app.engine.backends.parallel import kv as parallel_kv
from serve_app.engine.backends.parallel import plan
from serve_app.engine.kv_transfer import ImportedPrefill, KVPayload
from serve_app.engine.llm import LLM

pytestmark = pytest.mark.usefixtures("one_tokenizer_per_model")

# chunked prefill (a 32-token budget), prefix caching, and a pool small enough to preempt
SMALL = dict(
    dtype="float32", device="cpu", block_size=8, num_kv_blocks=16, max_prefill_tokens=32,
    max_input_token_len=32, max_seq_len=128, max_iter_times=24,
)  # fmt: skip


def _config(heads=9, kv=3, inter=1536, **extra):
    return LlamaConfig(
        num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
        hidden_size=64 * heads, **extra,
    )  # fmt: skip


# -- the split itself (no processes) ------------------------------------------------------------


def test_world_sizes_that_do_not_split_the_model_are_refused_naming_worldsize():
    smollm2 = _config()  # SmolLM2-135M's heads: 9 query, 3 KV
    assert plan.problems(smollm2, 1) == [] and plan.problems(smollm2, 3) == []
    (problem,) = plan.problems(smollm2, 2)
    assert "worldSize 2" in problem and "9 attention heads" in problem and "1, 3, 9" in problem
    assert plan.problems(_config(heads=8, kv=2, inter=1408), 4) == []  # KV heads replicated
    (problem,) = plan.problems(_config(heads=12, kv=8, inter=1536), 3)
    assert "worldSize 3" in problem and "8 KV heads" in problem
    (problem,) = plan.problems(_config(heads=8, kv=8, inter=1000), 16)[-1:]
    assert "MLP size (1000)" in problem
    no_plan = _config()
    no_plan.base_model_tp_plan = None
    assert "no tensor-parallel plan" in plan.problems(no_plan, 3)[0]


def test_ranks_beyond_the_kv_heads_share_them():
    cfg = _config(heads=8, kv=2, inter=1408)
    splits = [plan.split_for(cfg, r, 4) for r in range(4)]
    assert [(s.heads, s.kv_heads, s.kv_head_start) for s in splits] == [
        (2, 1, 0), (2, 1, 0), (2, 1, 1), (2, 1, 1),
    ]  # fmt: skip
    assert [plan.split_for(cfg, r, 2).kv_head_start for r in range(2)] == [0, 1]


@pytest.mark.parametrize("world", [2, 4])
def test_kv_heads_merge_and_part_round_trip(world):
    cfg = _config(heads=8, kv=2, inter=1408)
    splits = [plan.split_for(cfg, r, world) for r in range(world)]
    keys = [torch.randn(5, 2, 3) for _ in range(2)]
    values = [torch.randn(5, 2, 3) for _ in range(2)]
    whole = KVPayload(5, keys, values, torch.float32)
    parts = [parallel_kv.part(whole, s) for s in splits]
    assert all(p.keys[0].shape == (5, 1, 3) for p in parts)
    merged = parallel_kv.merge(parts, splits)
    for a, b in zip(merged.keys + merged.values, keys + values, strict=True):
        torch.testing.assert_close(a, b)


# -- loading a rank's part ----------------------------------------------------------------------


def _read_elements(monkeypatch) -> dict[str, int]:
    """How many elements of each tensor the rank's loader reads from safetensors files."""
    from serve_app.engine.backends.parallel import load

    read: dict[str, int] = {}
    real_open = load.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self.handle = real_open(*args, **kwargs)

        def __enter__(self):
            self.file = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            t = self.file.get_tensor(name)
            read[name] = read.get(name, 0) + t.numel()
            return t

        def get_slice(self, name):
            handle = self.file

            class Slice:
                def __getitem__(self, index):
                    t = handle.get_slice(name)[index]
                    read[name] = read.get(name, 0) + t.numel()
                    return t

            return Slice()

    monkeypatch.setattr(load, "safe_open", Counting)
    return read


@pytest.mark.parametrize(("model", "world"), [("demo-tiny", 2), ("demo-tiny", 4), ("smollm2", 3)])
def test_each_rank_reads_only_its_part_of_the_split_weights(model, world, monkeypatch):
    """A rank's model is the whole model sliced for it, and the rank read from the checkpoint
    only its slice of each split weight (a model too big for one device or host loads)."""
    from serve_app.engine.backends.parallel.load import load_part
    from serve_app.models.loader import load_config, load_model, resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct" if model == "smollm2" else model)
    cfg = load_config(path)
    read = _read_elements(monkeypatch)
    for rank in range(world):
        split = plan.split_for(cfg, rank, world)
        read.clear()
        part = load_part(path, torch.float32, torch.device("cpu"), split).state_dict()
        expected = load_model(path, torch.float32, torch.device("cpu"))
        wanted = plan.parts(expected, split)
        assert wanted and plan.apply(expected, split) == len(wanted)
        expected = expected.state_dict()
        assert part.keys() == expected.keys()
        for name, t in expected.items():
            assert torch.equal(part[name], t), name
        for name in wanted:  # a dropped bias (rowwise, rank > 0) is not read at all
            kept = expected.get(name)
            assert read.get(name, 0) == (0 if kept is None else kept.numel()), name


def test_a_checkpoint_without_safetensors_is_split_on_the_host(tmp_path):
    """Weights in pytorch_model.bin (no slice can be read from it): loaded whole on the host and
    sliced there, the same part."""
    import shutil

    from safetensors.torch import load_file

    from serve_app.engine.backends.parallel.load import load_part
    from serve_app.models.loader import load_config, resolve_model_path

    source = resolve_model_path("demo-tiny")
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    weights = tmp_path / "model.safetensors"
    torch.save(load_file(weights), tmp_path / "pytorch_model.bin")
    weights.unlink()
    split = plan.split_for(load_config(source), 1, 2)
    from_bin = load_part(tmp_path, torch.float32, torch.device("cpu"), split).state_dict()
    expected = load_part(source, torch.float32, torch.device("cpu"), split).state_dict()
    assert from_bin.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(from_bin[name], t), name


# -- over ranks ---------------------------------------------------------------------------------


@pytest.fixture(scope="class")
def demo_engines():
    """One process runs one split model at a time (torch.distributed's one default group): the
    tests that start their own come after this class's."""
    engines = {w: LLM("demo", world_size=w, **SMALL) for w in (1, 2)}
    yield engines
    for llm in engines.values():
        llm.close()


def test_the_ranks_size_the_kv_pool_by_the_least_free_memory(monkeypatch):
    """Sized by free device memory (neither kvCacheBlocks nor npuMemSize), each rank measures
    its own device: rank 1 has room for 64 blocks here, rank 0 for 2 GiB's worth. The pool is
    the least of them on every rank, or rank 0 would hand out block ids rank 1 does not have."""
    from serve_app.engine.backends.parallel import local

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    settings = {**SMALL, "num_kv_blocks": 0}
    with LLM("demo-tiny", **{**SMALL, "num_kv_blocks": 64}) as llm:
        expected = tokens(llm.generate(_prompts(), params))
    # rank 1's process: its device has 256 KiB free for the KV pool
    little = "from serve_app.engine.backends import cpu; "
    little += "cpu.CPUBackend.kv_budget_bytes = lambda self: 1 << 18; "
    monkeypatch.setattr(local, "START", little + local.START)
    with LLM("demo-tiny", world_size=2, **settings) as llm:
        runner = llm.engine.runner
        assert runner.bytes_per_block == 4096  # one of demo-tiny's two KV heads a rank
        assert runner.num_blocks == 64 == llm.engine.stats()["num_blocks"]
        assert tokens(llm.generate(_prompts(), params)) == expected


def test_ranks_of_this_machine_need_a_device_each(monkeypatch):
    """Offline (no Ray to show each rank its own device) rank r takes device r: a world size
    beyond the devices this process sees is refused, not two ranks put on one device."""
    from serve_app.engine.backends.device import check_local_ranks

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="worldSize 2 needs 2 cuda devices, one a rank; this "
                       "process sees 1"):  # fmt: skip
        check_local_ranks(torch.device("cuda", 0), 2)
    check_local_ranks(torch.device("cuda", 0), 1)
    check_local_ranks(torch.device("cpu"), 8)  # CPU ranks share the host


def _prompts(vocab: int = 150000):
    generator = torch.Generator().manual_seed(7)
    shared = torch.randint(0, vocab, (20,), generator=generator).tolist()
    tails = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (9, 12, 3)]
    # a shared 20-token prefix (prefix reuse), prompts over the 32-token prefill budget
    return [shared + t for t in tails] + [tails[0]]


def _logprobs(output):
    return torch.tensor([lp.logprob for lp in output.outputs[0].logprobs])


class TestDemoOverTwoRanks:
    def test_the_demo_over_two_ranks_is_the_demo_on_one(self, demo_engines):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
        prompts = _prompts()
        runs = {w: llm.generate(prompts, params) for w, llm in demo_engines.items()}
        assert tokens(runs[2]) == tokens(runs[1])
        for one, two in zip(runs[1], runs[2], strict=True):
            torch.testing.assert_close(_logprobs(two), _logprobs(one), atol=1e-4, rtol=0)
        again = demo_engines[2].generate(prompts[:1], params)  # its prefix is cached now
        assert tokens(again) == tokens(runs[1][:1])
        stats = demo_engines[2].engine.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
        for llm in demo_engines.values():
            assert_idle(llm)

    @pytest.mark.parametrize(
        "params",
        [
            SamplingParams(n=3, use_beam_search=True, temperature=0, max_tokens=6, ignore_eos=True),
            SamplingParams(n=2, best_of=3, temperature=0.8, seed=5, max_tokens=8, ignore_eos=True),
        ],
        ids=["beam", "seeded-best-of"],
    )
    def test_beam_search_and_seeded_sampling_over_two_ranks(self, demo_engines, params):
        prompts = _prompts()[1:3]
        one, two = (demo_engines[w].generate(prompts, params) for w in (1, 2))
        for a, b in zip(one, two, strict=True):
            assert [c.token_ids for c in b.outputs] == [c.token_ids for c in a.outputs]
        assert_idle(demo_engines[2])

    def test_structured_output_over_two_ranks(self, demo_engines):
        """The grammar is rank 0's, as sampling is: the same JSON as on one rank."""
        import json

        from serve_app.structured import json_object

        params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, constraint=json_object())
        one, two = (demo_engines[w].generate(_prompts()[1:3], params) for w in (1, 2))
        assert tokens(two) == tokens(one)
        for output in two:
            assert isinstance(json.loads(output.outputs[0].text), dict)
        assert_idle(demo_engines[2])

    @pytest.mark.parametrize("prefill_world, decode_world", [(2, 1), (1, 2)])
    def test_the_pd_hand_off_moves_every_kv_head_between_world_sizes(
        self, demo_engines, prefill_world, decode_world
    ):
        prefill = demo_engines[prefill_world].engine
        decode = demo_engines[decode_world].engine
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
        prompt = _prompts()[0]
        (expected,) = demo_engines[1].generate([prompt], params)
        prefill.add_request(EngineRequest("p", prompt, params, export_kv=True))
        exported = run_to_end(prefill)["p"]
        payload = exported.kv_payload
        assert payload.keys[0].shape[1] == 2  # the demo's two KV heads, whatever the world size
        first = exported.outputs[0].token_ids[0]
        imported = ImportedPrefill(first, payload, None, max_output_tokens=10)
        decode.add_request(EngineRequest("d", prompt, params, imported=imported))
        decoded = run_to_end(decode)["d"]
        assert decoded.outputs[0].token_ids == expected.outputs[0].token_ids
        # (the decode side reports the tokens after the first: they read the moved KV)
        after_first = _logprobs(expected)[1:]
        torch.testing.assert_close(
            _logprobs(decoded)[-len(after_first) :], after_first, atol=1e-4, rtol=0
        )


@pytest.mark.timeout(300)
def test_smollm2_over_three_ranks_is_smollm2_on_one():
    """SmolLM2's 9 query and 3 KV heads over 3 ranks, through chunked prefill, prefix reuse and
    preemption (SMALL's prefill budget and pool), and beam search: the tokens and
    log-probabilities of SmolLM2 on one rank."""
    prompts = _prompts(vocab=49152)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    beam = SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=4, ignore_eos=True)
    runs = {}
    for world in (1, 3):
        with LLM("smollm2-135m-instruct", world_size=world, **SMALL) as llm:
            outputs = llm.generate(prompts, greedy)
            again = llm.generate(prompts[:1], greedy)  # its prefix is cached now
            beams = llm.generate(prompts[1:3], beam)
            stats = llm.engine.stats()
            assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
            assert_idle(llm)
        runs[world] = outputs, tokens(again), [[c.token_ids for c in b.outputs] for b in beams]
    assert tokens(runs[3][0]) == tokens(runs[1][0])
    for one, three in zip(runs[1][0], runs[3][0], strict=True):
        torch.testing.assert_close(_logprobs(three), _logprobs(one), atol=1e-4, rtol=0)
    assert runs[3][1:] == runs[1][1:]


def test_a_world_size_the_model_cannot_split_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match=r"worldSize 3 does not divide the model's 8 attention"):
        LLM("demo", world_size=3, **SMALL)


def test_a_dead_rank_fails_the_next_step_at_once():
    llm = LLM("demo-tiny", world_size=2, **SMALL)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(tokens(llm.generate([[1, 2, 3]], params))[0]) == 4
    (rank,) = llm.engine.runner.local_ranks.processes
    os.kill(rank.pid, signal.SIGKILL)
    rank.wait()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worldSize 2"):
        llm.generate([[1, 2, 3]], params)
    assert time.monotonic() - start < 10
    llm.close()


def test_ranks_beyond_the_kv_heads_give_the_same_tokens_and_end_with_the_engine():
    """demo-tiny's 2 KV heads over 4 ranks: each KV head held (and cached) by two ranks."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = _prompts()
    runs = {}
    for world in (1, 4):
        with LLM("demo-tiny", world_size=world, **SMALL) as llm:
            runs[world] = llm.generate(prompts, params)
            ranks = llm.engine.runner.local_ranks
    assert all(rank.poll() is not None for rank in ranks.processes)  # stopped with the engine
    assert tokens(runs[4]) == tokens(runs[1])
    for one, four in zip(runs[1], runs[4], strict=True):
        torch.testing.assert_close(_logprobs(four), _logprobs(one), atol=1e-4, rtol=0)


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "thread"])
def test_an_engine_drives_its_own_ranks_and_takes_them_when_it_stops(engine_process):
    import asyncio

    import psutil

    from serve_app.engine import EngineConfig
    from serve_app.engine.host.async_engine import AsyncEngine

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = _prompts()[0]
    with LLM("demo-tiny", **SMALL) as llm:
        (expected,) = tokens(llm.generate([prompt], params))
    settings = {**SMALL, "model": "demo-tiny", "engine_process": engine_process, "world_size": 2}
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    engine = AsyncEngine(EngineConfig(**settings))
    children = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]

    async def generate():
        async for output in engine.generate(EngineRequest("ep", prompt, params)):
            last = output
        return last.outputs[0].token_ids

    try:
        assert "split over 2 ranks (worldSize)" in engine.info.placement()  # the ready line's
        assert asyncio.run(generate()) == expected
        if engine_process:  # the engine process, and its rank 1 under it
            (process,) = [c for c in children if c.ppid() == os.getpid()]
            assert [c.ppid() for c in children if c != process] == [process.pid]
        else:  # rank 1, under this process (rank 0, its engine on a thread)
            assert [c.ppid() for c in children] == [os.getpid()]
    finally:
        engine.shutdown()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive


def test_ranks_on_the_strict_fake_npu_over_hccl(monkeypatch):
    """Every rank's attention through the NPU backend on the strict fake torch_npu (each rank's
    heads through the kernels' documented shape rules), the collectives on a backend named
    "hccl" (gloo underneath): the tokens and log-probabilities of the CPU engine on one device."""
    import sys

    import fake_npu_ranks
    import torch.distributed as dist

    from serve_app.engine.backends.parallel import group, local
    from serve_app.engine.backends.runner import ModelRunner

    npu = dict(SMALL, block_size=128, num_kv_blocks=8, max_seq_len=256)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = _prompts()
    with LLM("demo-tiny", **npu) as llm:
        expected = llm.generate(prompts, params)
    for name in ("torch_npu",):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name))
    monkeypatch.setitem(group.BACKENDS, "cpu", group.BACKENDS["cpu"])
    monkeypatch.setattr(ModelRunner, "__init__", ModelRunner.__init__)
    monkeypatch.setattr(local, "START", fake_npu_ranks.START)
    fake_npu_ranks.install()
    with LLM("demo-tiny", world_size=2, **npu) as llm:
        assert dist.get_backend() == "hccl"
        got = llm.generate(prompts, params)
        fake = sys.modules["torch_npu"]
        assert {"paged_attention", "fused_infer_attention_score"} <= set(fake.names())
    assert tokens(got) == tokens(expected)
    for one, two in zip(expected, got, strict=True):
        torch.testing.assert_close(_logprobs(two), _logprobs(one), atol=1e-4, rtol=0)
