"""The EmbeddingConfig[] section, its Deployments options, and how the builder binds one
embedding deployment per endpoint (no Ray cluster: binding only)."""

from __future__ import annotations

import pydantic
import pytest

from serve_app.app import build_app, embedding_deployment_name
from serve_app.config import ConfigError, EmbeddingConfig, load_config
from serve_app.deployment_options import SERVE_FAST_PATH_ENV, embedding_replica_options

MINILM = {"endpointName": "all-minilm-l6-v2", "modelWeightPath": "all-minilm-l6-v2"}


def error_of(args) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(args)
    return str(info.value)


def test_no_embedding_endpoint_by_default():
    config = load_config()
    assert config.EmbeddingConfig == () and config.embedding_names == []


def test_names_defaults_and_order():
    config = load_config({"EmbeddingConfig": [{}, {"endpointName": "mini-2", "maxBatchSize": 8}]})
    assert config.embedding_names == ["all-minilm-l6-v2", "mini-2"]
    first, second = config.EmbeddingConfig
    assert (first.modelWeightPath, first.maxBatchSize) == ("all-minilm-l6-v2", 32)
    assert (second.modelWeightPath, second.maxBatchSize) == ("all-minilm-l6-v2", 8)


def test_unknown_keys_are_refused_with_a_suggestion():
    message = error_of({"EmbeddingConfig": [{"endpointNam": "x"}]})
    assert "EmbeddingConfig[0].endpointNam: unknown key" in message
    assert "did you mean 'endpointName'" in message
    message = error_of({"Deployments": {"EmbeddingReplca": {}}})
    assert "did you mean 'EmbeddingReplica'" in message


@pytest.mark.parametrize(
    "item, expected",
    [
        ({"maxBatchSize": 0}, "EmbeddingConfig[0].maxBatchSize: must be >= 1"),
        ({"maxBatchSize": 1025}, "EmbeddingConfig[0].maxBatchSize: must be <= 1024"),
        ({"endpointName": "-mini"}, "EmbeddingConfig[0].endpointName: '-mini' must be letters"),
        ({"endpointName": "a/b"}, "EmbeddingConfig[0].endpointName: 'a/b' must be letters"),
        ({"modelWeightPath": ""}, "EmbeddingConfig[0].modelWeightPath"),
    ],
)
def test_bad_values_name_their_key(item, expected):
    assert expected in error_of({"EmbeddingConfig": [item]})


def test_names_are_unique_among_endpoints_and_models():
    message = error_of({"EmbeddingConfig": [MINILM, MINILM]})
    assert "EmbeddingConfig[1].endpointName ('all-minilm-l6-v2') repeats " in message
    assert "EmbeddingConfig[0].endpointName; names must be unique" in message
    message = error_of({"EmbeddingConfig": [{"endpointName": "demo"}]})
    assert "repeats BackendConfig.ModelDeployConfig.ModelConfig[0].modelName" in message


def test_frozen_and_described():
    item = load_config({"EmbeddingConfig": [{}]}).EmbeddingConfig[0]
    with pytest.raises(pydantic.ValidationError):
        item.maxBatchSize = 2
    for name, field in EmbeddingConfig.model_fields.items():
        assert field.description, name


def test_deployment_options_default_to_one_cpu_and_merge_the_users():
    config = load_config({"EmbeddingConfig": [{}]})
    options = embedding_replica_options(config)
    assert options["num_replicas"] == 1
    assert options["ray_actor_options"] == {
        "num_cpus": 1, "runtime_env": {"env_vars": SERVE_FAST_PATH_ENV},
    }  # fmt: skip
    config = load_config(
        {
            "EmbeddingConfig": [{}],
            "Deployments": {
                "EmbeddingReplica": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0}}
            },
        }
    )
    options = embedding_replica_options(config)
    assert options["num_replicas"] == 2 and options["ray_actor_options"]["num_cpus"] == 0


def test_deployment_names_mirror_the_model_replicas():
    one = load_config({"EmbeddingConfig": [{}]})
    assert embedding_deployment_name(one, 0) == "EmbeddingReplica"
    two = load_config({"EmbeddingConfig": [{}, {"endpointName": "mini-2"}]})
    assert [embedding_deployment_name(two, i) for i in range(2)] == [
        "EmbeddingReplica-all-minilm-l6-v2", "EmbeddingReplica-mini-2",
    ]  # fmt: skip


def test_the_builder_binds_one_deployment_per_endpoint_and_waits_for_them():
    ingress = build_app({"EmbeddingConfig": [{}, {"endpointName": "mini-2"}]})._bound_deployment
    readiness = ingress.init_args[3]
    assert readiness == [
        "ModelReplica", "EmbeddingReplica-all-minilm-l6-v2", "EmbeddingReplica-mini-2",
    ]  # fmt: skip
    bound = {name: app._bound_deployment for name, app in ingress.init_kwargs["embedding"].items()}
    assert list(bound) == ["all-minilm-l6-v2", "mini-2"]
    assert [d.name for d in bound.values()] == readiness[1:]
    assert [d.init_args[1] for d in bound.values()] == [0, 1]  # each its EmbeddingConfig item
    assert all(d.init_kwargs == {"off_engine_cores": True} for d in bound.values())
    assert build_app({})._bound_deployment.init_kwargs["embedding"] == {}
