"""serve_app.config: MindIE config.json names, defaults, ranges and load-time cross checks."""

import json

import pydantic
import pytest
import yaml

from serve_app.config import (
    AppConfig,
    BackendConfig,
    ConfigError,
    ModelConfig,
    ModelDeployConfig,
    ScheduleConfig,
    ServerConfig,
    load_config,
)

SCHED = "BackendConfig.ScheduleConfig"
DEPLOY = "BackendConfig.ModelDeployConfig"


def nest(dotted: str, value) -> dict:
    """'A.B.c', 1 -> {'A': {'B': {'c': 1}}}; a part 'ModelConfig' wraps its dict in a list."""
    out = value
    for part in reversed(dotted.split(".")):
        out = {part: [out] if part == "ModelConfig" else out}
    return out


def merge(*dicts: dict) -> dict:
    out: dict = {}
    for d in dicts:
        for key, value in d.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            elif isinstance(value, list) and isinstance(out.get(key), list):
                out[key] = [merge(a, b) for a, b in zip(out[key], value, strict=True)]
            else:
                out[key] = value
    return out


def config(**dotted) -> dict:
    """config(**{"BackendConfig.ScheduleConfig.maxBatchSize": 8}) -> nested args dict."""
    return merge(*(nest(key, value) for key, value in dotted.items()))


def error_of(args) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(args)
    return str(info.value)


# ---- defaults and sources --------------------------------------------------------------------


@pytest.mark.parametrize("source", [None, {}])
def test_defaults(source):
    cfg = load_config(source)
    assert cfg == AppConfig()
    assert cfg.ServerConfig.port == 8000
    assert cfg.ServerConfig.httpsEnabled is False
    assert cfg.ServerConfig.inferMode == "standard"
    assert cfg.BackendConfig.tokenizerProcessNumber == 8
    assert cfg.BackendConfig.npuDeviceIds == ((0,),)
    deploy, sched = cfg.BackendConfig.ModelDeployConfig, cfg.BackendConfig.ScheduleConfig
    assert (deploy.maxSeqLen, deploy.maxInputTokenLen, deploy.truncation) == (2560, 2048, False)
    [model] = deploy.ModelConfig
    assert (model.modelName, model.modelWeightPath, model.npuMemSize) == ("demo", "demo", -1)
    assert (sched.maxBatchSize, sched.maxPrefillTokens, sched.maxIterTimes) == (200, 8192, 512)
    assert (sched.cacheBlockSize, sched.kvCacheBlocks, sched.enablePrefixCaching) == (128, 0, True)


FILE_CONFIG = {
    "ServerConfig": {"port": 9000, "tokenTimeout": 30},
    "BackendConfig": {
        "npuDeviceIds": [[0, 1]],
        "ModelDeployConfig": {
            "maxSeqLen": 1024,
            "maxInputTokenLen": 512,
            "ModelConfig": [{"modelName": "qwen", "modelWeightPath": "/w"}],
        },
        "ScheduleConfig": {"maxBatchSize": 64, "maxIterTimes": 256},
    },
}


@pytest.mark.parametrize(
    "suffix, dump", [(".yaml", yaml.safe_dump), (".yml", yaml.safe_dump), (".json", json.dumps)]
)
def test_file_sources(tmp_path, suffix, dump):
    path = tmp_path / f"config{suffix}"
    path.write_text(dump(FILE_CONFIG))
    for source in (path, str(path)):
        cfg = load_config(source)
        assert cfg == load_config(FILE_CONFIG)
        assert cfg.ServerConfig.port == 9000
        assert cfg.BackendConfig.npuDeviceIds == ((0, 1),)
        assert cfg.BackendConfig.ModelDeployConfig.ModelConfig[0].modelName == "qwen"
        assert cfg.BackendConfig.ScheduleConfig.maxIterTimes == 256


def test_empty_file_means_defaults(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("")
    assert load_config(path) == AppConfig()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[1, 2]", "must be a mapping"),
        ("a: [", "is not valid"),
        ("{", "is not valid"),
        (None, "cannot read config file"),
    ],
)
def test_bad_files(tmp_path, text, expected):
    path = tmp_path / ("config.json" if text == "{" else "config.yaml")
    if text is not None:
        path.write_text(text)
    assert expected in error_of(path)


def test_bad_source_type():
    assert "dict, a path or None" in error_of(42)


# ---- unknown keys -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, path, where",
    [
        ({"Foo": 1}, "Foo", "at the top level"),
        ({"ServerConfig": {"prot": 1}}, "ServerConfig.prot", "in ServerConfig"),
        (config(**{f"{SCHED}.maxBatchSiz": 3}), f"{SCHED}.maxBatchSiz", f"in {SCHED}"),
        (
            config(**{f"{DEPLOY}.ModelConfig.bogus": 1}),
            f"{DEPLOY}.ModelConfig[0].bogus",
            f"in {DEPLOY}.ModelConfig[0]",
        ),
    ],
)
def test_unknown_keys(args, path, where):
    key = path.rsplit(".", 1)[-1]
    assert f"{path}: unknown key '{key}' {where}" in error_of(args)


def test_unknown_key_hints():
    assert "did you mean 'maxBatchSize'" in error_of(config(**{f"{SCHED}.maxBatchSiz": 3}))
    assert "known keys: ServerConfig, BackendConfig" in error_of({"Foo": 1})


def test_every_problem_is_listed():
    message = error_of(
        config(**{f"{SCHED}.nope": 1, f"{SCHED}.maxBatchSize": 0, "ServerConfig.port": "x"})
    )
    lines = message.splitlines()[1:]
    assert len(lines) == 3
    assert any(line.strip().startswith(f"{SCHED}.maxBatchSize: must be >= 1") for line in lines)
    assert any(line.strip().startswith("ServerConfig.port:") for line in lines)


# ---- ranges -------------------------------------------------------------------------------------


RANGES = [  # dotted key, lowest valid, highest valid (None: unbounded), other keys needed
    ("ServerConfig.maxLinkNum", 1, 4096),
    ("ServerConfig.tokenTimeout", 1, 3600),
    ("ServerConfig.e2eTimeout", 1, 65535),
    ("ServerConfig.maxRequestLength", 1, 100),
    ("ServerConfig.streamInterval", 1, 1024),
    ("BackendConfig.tokenizerProcessNumber", 1, 32),
    (f"{DEPLOY}.maxInputTokenLen", 1, 4194304, {f"{SCHED}.maxPrefillTokens": 4194304}),
    (f"{DEPLOY}.maxSeqLen", 512, None),  # lower bound from maxIterTimes (512) <= maxSeqLen
    (f"{DEPLOY}.ModelConfig.worldSize", 1, None),
    (f"{DEPLOY}.ModelConfig.cpuMemSize", 0, None),
    (f"{SCHED}.cacheBlockSize", 1, 128),
    (f"{SCHED}.maxBatchSize", 50, 5000),  # lower bound from maxPrefillBatchSize (50)
    (f"{SCHED}.prefillPolicyType", 0, 3),
    (f"{SCHED}.decodePolicyType", 0, 3),
    (f"{SCHED}.maxPreemptCount", 0, None),
    (f"{SCHED}.kvCacheBlocks", 0, None),
]


@pytest.mark.parametrize("key, low, high, others", [(*r, {})[:4] for r in RANGES])
def test_ranges(key, low, high, others):
    load_config(config(**others, **{key: low}))
    path = key.replace("ModelConfig.", "ModelConfig[0].")
    if high is not None:
        load_config(config(**others, **{key: high}))
        message = error_of(config(**others, **{key: high + 1}))
        assert f"{path}: must be <= {high} (got {high + 1})" in message
    if low in (0, 1):  # a plain range bound, not a cross check
        message = error_of(config(**others, **{key: low - 1}))
        assert f"{path}: must be >= {low} (got {low - 1})" in message


@pytest.mark.parametrize(
    "key, value",
    [
        ("ServerConfig.inferMode", "pd"),
        ("ServerConfig.ipAddress", "localhost:80"),
        ("ServerConfig.port", 0),
        ("ServerConfig.port", 65536),
        (f"{SCHED}.templateType", "standard"),
        (f"{DEPLOY}.ModelConfig.dtype", "int8"),
        (f"{DEPLOY}.ModelConfig.device", "tpu"),
        (f"{DEPLOY}.ModelConfig.npuMemSize", 0),
        (f"{DEPLOY}.ModelConfig.npuMemSize", -2),
        (f"{DEPLOY}.ModelConfig.engineCpus", "one"),
        (f"{DEPLOY}.ModelConfig.engineCpus", "3-1"),
        (f"{DEPLOY}.ModelConfig.engineSpareCpus", "zero"),
        ("BackendConfig.npuDeviceIds", [[-1]]),
    ],
)
def test_bad_values(key, value):
    path = key.replace("ModelConfig.", "ModelConfig[0].")
    assert f"\n  {path}" in error_of(config(**{key: value}))


@pytest.mark.parametrize(
    "args, key",
    [
        ({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": []}}}, f"{DEPLOY}.ModelConfig"),
        ({"BackendConfig": {"npuDeviceIds": []}}, "BackendConfig.npuDeviceIds"),
    ],
)
def test_empty_lists(args, key):
    assert f"{key}: must have at least 1 item" in error_of(args)


def test_bad_item_is_not_reported_as_too_short():
    message = error_of(config(**{f"{DEPLOY}.ModelConfig.worldSize": 0}))
    assert "at least 1 item" not in message
    assert len(message.splitlines()) == 2


def test_engine_cpus_need_the_engine_process():
    message = error_of(config(**{f"{DEPLOY}.ModelConfig.engineCpus": "1"}))
    assert f"{DEPLOY}.ModelConfig[0]" in message and "needs engineProcess: true" in message


def test_spare_cores_need_the_engine_process_and_differ_from_its_own():
    key = f"{DEPLOY}.ModelConfig"
    message = error_of(config(**{f"{key}.engineSpareCpus": "0"}))
    assert f"{key}[0]" in message and "engineSpareCpus needs engineProcess: true" in message
    both = {f"{key}.engineProcess": True, f"{key}.engineCpus": "1", f"{key}.engineSpareCpus": "0-1"}
    assert "engineSpareCpus 1 are engineCpus too" in error_of(config(**both))
    fine = {f"{key}.engineProcess": True, f"{key}.engineCpus": "1", f"{key}.engineSpareCpus": "0"}
    cfg = load_config(config(**fine))
    assert cfg.engine_config().engine_spare_cpus == (0,)


def test_auto_cores_are_sized_where_the_engine_config_is_made(monkeypatch):
    """engineCpus / engineSpareCpus auto stay `auto` in the config (a replica sizes them to its
    own node) and come out of engine_config() as the node's split; auto binds the engine
    process, so it needs one."""
    from serve_app import placement

    key = f"{DEPLOY}.ModelConfig"
    auto = {f"{key}.engineProcess": True, f"{key}.engineCpus": "Auto",
            f"{key}.engineSpareCpus": "auto"}  # fmt: skip
    cfg = load_config(config(**auto))
    model = cfg.BackendConfig.ModelDeployConfig.ModelConfig[0]
    assert (model.engineCpus, model.engineSpareCpus) == ("auto", "auto")
    monkeypatch.setattr(placement, "node_cores", lambda: set(range(16)))
    engine = cfg.engine_config()
    assert engine.engine_cpus == tuple(range(2, 16)) and engine.engine_spare_cpus == (0, 1)
    message = error_of(config(**{f"{key}.engineCpus": "auto"}))
    assert f"{key}[0]" in message and "needs engineProcess: true" in message


def test_serving_cores_avoid_every_bound_engine():
    import os

    here = os.sched_getaffinity(0)
    models = [
        {"modelName": "a", "engineProcess": True, "engineCpus": str(min(here))},
        {"modelName": "b", "engineProcess": True},
    ]
    cfg = load_config({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": models}}})
    assert cfg.serving_cores() == (here - {min(here)} or None)
    assert load_config().serving_cores() is None


@pytest.mark.parametrize("value", [0.5, 24, -1])
def test_npu_mem_size(value):
    assert load_config(config(**{f"{DEPLOY}.ModelConfig.npuMemSize": value}))


# ---- modelName ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["demo", "Qwen2.5-7B_instruct", "a", "7", "x" * 256])
def test_model_name_ok(name):
    cfg = load_config(config(**{f"{DEPLOY}.ModelConfig.modelName": name}))
    assert cfg.BackendConfig.ModelDeployConfig.ModelConfig[0].modelName == name


@pytest.mark.parametrize(
    "name", ["", "-a", "a-", ".a", "a.", "_a", "a_", "a b", "a/b", "é", "x" * 257]
)
def test_model_name_bad(name):
    assert f"{DEPLOY}.ModelConfig[0].modelName:" in error_of(
        config(**{f"{DEPLOY}.ModelConfig.modelName": name})
    )


# ---- cross checks -------------------------------------------------------------------------------


CROSS = [  # (failing values, passing values at the boundary, both keys named in the message)
    (
        {f"{SCHED}.maxPrefillTokens": 1024, f"{DEPLOY}.maxInputTokenLen": 1025},
        {f"{SCHED}.maxPrefillTokens": 1024, f"{DEPLOY}.maxInputTokenLen": 1024},
        f"{SCHED}.maxPrefillTokens (1024) must be >= {DEPLOY}.maxInputTokenLen (1025)",
    ),
    (
        {f"{SCHED}.maxIterTimes": 101, f"{DEPLOY}.maxSeqLen": 100},
        {f"{SCHED}.maxIterTimes": 100, f"{DEPLOY}.maxSeqLen": 100},
        f"{SCHED}.maxIterTimes (101) must be <= {DEPLOY}.maxSeqLen (100)",
    ),
    (
        {f"{SCHED}.maxPrefillBatchSize": 9, f"{SCHED}.maxBatchSize": 8},
        {f"{SCHED}.maxPrefillBatchSize": 8, f"{SCHED}.maxBatchSize": 8},
        f"{SCHED}.maxPrefillBatchSize (9) must be <= {SCHED}.maxBatchSize (8)",
    ),
    (
        {f"{SCHED}.maxPreemptCount": 201, f"{SCHED}.maxBatchSize": 200},
        {f"{SCHED}.maxPreemptCount": 200, f"{SCHED}.maxBatchSize": 200},
        f"{SCHED}.maxPreemptCount (201) must be <= {SCHED}.maxBatchSize (200)",
    ),
    (
        {f"{SCHED}.maxPreemptCount": 1, f"{DEPLOY}.ModelConfig.cpuMemSize": 0},
        {f"{SCHED}.maxPreemptCount": 0, f"{DEPLOY}.ModelConfig.cpuMemSize": 0},
        f"{SCHED}.maxPreemptCount (1) > 0 requires {DEPLOY}.ModelConfig[0].cpuMemSize > 0 (got 0)",
    ),
]


@pytest.mark.parametrize("bad, boundary, message", CROSS)
def test_cross_checks(bad, boundary, message):
    assert message in error_of(config(**bad))
    load_config(config(**boundary))


def test_cross_checks_all_reported():
    message = error_of(config(**{k: v for bad, _, _ in CROSS[:2] for k, v in bad.items()}))
    assert all(m in message for _, _, m in CROSS[:2])


def test_preempt_needs_cpu_mem_on_every_model():
    models = [{"modelName": "a", "cpuMemSize": 1}, {"modelName": "b", "cpuMemSize": 0}]
    args = {
        "BackendConfig": {
            "ModelDeployConfig": {"ModelConfig": models},
            "ScheduleConfig": {"maxPreemptCount": 1},
        }
    }
    message = error_of(args)
    assert f"{DEPLOY}.ModelConfig[1].cpuMemSize" in message
    assert f"{DEPLOY}.ModelConfig[0].cpuMemSize" not in message


def test_model_names_unique():
    models = [{"modelName": "a"}, {"modelName": "b"}, {"modelName": "a"}]
    message = error_of({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": models}}})
    assert f"{DEPLOY}.ModelConfig[2].modelName ('a')" in message
    assert f"{DEPLOY}.ModelConfig[0].modelName" in message
    models[2]["modelName"] = "c"
    load_config({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": models}}})


# ---- engine config and immutability -------------------------------------------------------------


def test_engine_config_maps_every_field():
    from serve_app.engine.config import EngineConfig

    models = [
        {"modelName": "first"},
        {
            "modelName": "second",
            "modelWeightPath": "/weights/q",
            "dtype": "bfloat16",
            "device": "cpu",
            "npuMemSize": 3,
            "engineProcess": True,
            "engineCpus": "2-3,0",
            "enforceEager": True,
        },
    ]
    cfg = load_config(
        {
            "ServerConfig": {"tokenTimeout": 7, "e2eTimeout": 70},
            "BackendConfig": {
                "ModelDeployConfig": {
                    "maxSeqLen": 1000,
                    "maxInputTokenLen": 900,
                    "truncation": True,
                    "ModelConfig": models,
                },
                "ScheduleConfig": {
                    "maxIterTimes": 300,
                    "maxBatchSize": 40,
                    "maxPrefillBatchSize": 5,
                    "maxPrefillTokens": 4000,
                    "cacheBlockSize": 16,
                    "kvCacheBlocks": 99,
                    "enablePrefixCaching": False,
                },
            },
        }
    )
    engine = cfg.engine_config(1)
    assert isinstance(engine, EngineConfig)
    assert engine == EngineConfig(
        model="/weights/q",
        model_name="second",
        dtype="bfloat16",
        device="cpu",
        max_seq_len=1000,
        max_input_token_len=900,
        truncation=True,
        max_iter_times=300,
        max_batch_size=40,
        max_prefill_batch_size=5,
        max_prefill_tokens=4000,
        block_size=16,
        num_kv_blocks=99,
        kv_cache_mem_gb=3.0,
        enable_prefix_caching=False,
        token_timeout_s=7.0,
        e2e_timeout_s=70.0,
        engine_process=True,
        engine_cpus=(0, 2, 3),
        enforce_eager=True,
    )
    assert cfg.BackendConfig.ModelDeployConfig.ModelConfig[1].engineCpus == "0,2,3"
    assert cfg.engine_config().model_name == "first"
    assert load_config().engine_config() == EngineConfig()
    with pytest.raises(IndexError):
        cfg.engine_config(2)


@pytest.mark.parametrize(
    "get, attr",
    [
        (lambda c: c, "ServerConfig"),
        (lambda c: c.ServerConfig, "port"),
        (lambda c: c.BackendConfig.ScheduleConfig, "maxBatchSize"),
        (lambda c: c.BackendConfig.ModelDeployConfig.ModelConfig[0], "modelName"),
    ],
)
def test_frozen(get, attr):
    section = get(load_config())
    with pytest.raises(pydantic.ValidationError):
        setattr(section, attr, 1)


def test_lists_are_immutable():
    deploy = load_config().BackendConfig.ModelDeployConfig
    with pytest.raises(AttributeError):
        deploy.ModelConfig.append(deploy.ModelConfig[0])  # type: ignore[attr-defined]


def test_every_field_has_a_description():
    for model in (
        AppConfig,
        ServerConfig,
        BackendConfig,
        ModelDeployConfig,
        ModelConfig,
        ScheduleConfig,
    ):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name}"
