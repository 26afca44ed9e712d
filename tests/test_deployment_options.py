"""The Deployments section and the Ray Serve options derived from the config (no Ray)."""

from __future__ import annotations

import warnings

import pytest

from serve_app.config import ConfigError, load_config
from serve_app.deployment_options import (
    SERVE_FAST_PATH_ENV,
    admission_limits,
    ingress_options,
    model_replica_options,
    tokenizer_pool_options,
)


def test_unknown_keys_are_named_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"Deployments.ModelReplica.num_replica.*num_replicas"):
        load_config({"Deployments": {"ModelReplica": {"num_replica": 2}}})
    with pytest.raises(ConfigError, match="unknown ray_actor_options key"):
        load_config({"Deployments": {"Decode": {"ray_actor_options": {"npu": 1}}}})


@pytest.mark.parametrize(
    "resources, device, expect",
    [
        # num_cpus auto: of 64 CPUs 8 kept for serving, the rest split among 8 NPU ranks
        ({"NPU": 8, "CPU": 64}, "auto", {"num_cpus": 7, "resources": {"NPU": 1}}),
        ({"GPU": 4}, "auto", {"num_cpus": 1, "num_gpus": 1}),  # (no CPUs: nothing to size)
        ({"CPU": 2}, "auto", {"num_cpus": 0.5}),  # 1 CPU kept, 1 for the two CPU ranks
        ({"CPU": 2}, "npu", {"num_cpus": 1, "resources": {"NPU": 1}}),
        ({"NPU": 8}, "cpu", {"num_cpus": 1}),
    ],
)
def test_model_replicas_ask_for_their_accelerator(resources, device, expect):
    """The replica holds one device (rank 0); worldSize 2 adds a bundle of the same for rank 1,
    both on one node."""
    config = load_config(
        {
            "BackendConfig": {
                "ModelDeployConfig": {
                    "ModelConfig": [{"worldSize": 2, "device": device, "modelWeightPath": "demo"}]
                }
            }
        }
    )
    options = model_replica_options(config, 0, resources)
    actor = options["ray_actor_options"]
    assert actor == {**expect, "runtime_env": {"env_vars": SERVE_FAST_PATH_ENV}}
    bundle = {"CPU": expect["num_cpus"], **expect.get("resources", {})}
    if "num_gpus" in expect:
        bundle["GPU"] = 1
    assert options["placement_group_bundles"] == [bundle, bundle]
    assert options["placement_group_strategy"] == "STRICT_PACK"


def test_more_ranks_than_a_node_has_devices_is_refused_when_the_app_is_built(monkeypatch):
    from serve_app import deployment_options

    model = {"worldSize": 4, "modelWeightPath": "demo", "device": "npu"}
    config = load_config({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [model]}}})
    monkeypatch.setattr(deployment_options, "_most_per_node", lambda key: {"NPU": 2}[key])
    with pytest.raises(ValueError, match="worldSize 4: .* no node .* more than 2 NPU"):
        model_replica_options(config, 0)
    monkeypatch.setattr(deployment_options, "_most_per_node", lambda key: 8)
    assert len(model_replica_options(config, 0)["placement_group_bundles"]) == 4
    # no running node has an NPU yet (a cluster that starts its NPU nodes on demand): not refused
    monkeypatch.setattr(deployment_options, "_most_per_node", lambda key: 0)
    assert len(model_replica_options(config, 0)["placement_group_bundles"]) == 4


def test_a_replica_of_one_device_has_no_placement_group_and_user_bundles_win():
    one = load_config({})
    assert "placement_group_bundles" not in model_replica_options(one, 0, {"NPU": 8})
    model = {"worldSize": 2, "modelWeightPath": "demo"}
    bundles = [{"CPU": 2, "NPU": 1}, {"CPU": 1, "NPU": 1}]
    config = load_config({
        "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [model]}},
        "Deployments": {"ModelReplica": {"placement_group_bundles": bundles,
                                         "ray_actor_options": {"num_cpus": 2}}},
    })  # fmt: skip
    options = model_replica_options(config, 0, {"NPU": 8})
    assert options["placement_group_bundles"] == bundles
    assert "placement_group_strategy" not in options
    spread = load_config({
        "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [model]}},
        "Deployments": {"ModelReplica": {"max_replicas_per_node": 1}},
    })  # fmt: skip
    with pytest.raises(ValueError, match="worldSize 2 .* max_replicas_per_node"):
        model_replica_options(spread, 0, {"NPU": 8})


def test_user_options_merge_over_the_derived_ones_per_role():
    config = load_config(
        {
            "ServerConfig": {"inferMode": "dmi"},
            "Deployments": {
                "Prefill": {"num_replicas": 2, "ray_actor_options": {"resources": {"foo": 1}}},
                "Decode": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}},
            },
        }
    )
    prefill = model_replica_options(config, 0, {"NPU": 2}, role="prefill")
    assert prefill["num_replicas"] == 2
    assert prefill["ray_actor_options"]["resources"] == {"NPU": 1, "foo": 1}
    decode = model_replica_options(config, 0, {"NPU": 2}, role="decode")
    assert "num_replicas" not in decode and decode["autoscaling_config"]["max_replicas"] == 4
    assert model_replica_options(config, 0, {"NPU": 2})["num_replicas"] == 1  # colocated default


def test_autoscaling_targets_the_engines_batch_unless_the_user_says():
    sched = {"ScheduleConfig": {"maxBatchSize": 48, "maxPrefillBatchSize": 16}}
    auto = load_config(
        {"BackendConfig": sched, "Deployments": {"ModelReplica": {"num_replicas": "auto"}}}
    )
    options = model_replica_options(auto, 0, {"CPU": 2})
    assert options["num_replicas"] == "auto"
    # the load reaches the autoscaler every 2 s, not Ray Serve's 10
    assert options["autoscaling_config"] == {
        "target_ongoing_requests": 48, "metrics_interval_s": 2.0
    }  # fmt: skip
    own = {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}
    }
    mine = load_config(
        {
            "BackendConfig": sched,
            "Deployments": {"Decode": own},
            "ServerConfig": {"inferMode": "dmi"},
        }
    )
    decode = model_replica_options(mine, 0, {"CPU": 2}, role="decode")
    assert decode["autoscaling_config"]["target_ongoing_requests"] == 8
    # and always below a window the user shortened, as Ray Serve requires (a warning today)
    quick = load_config(
        {"Deployments": {"ModelReplica": {"autoscaling_config": {"look_back_period_s": 1}}}}
    )
    scaling = model_replica_options(quick, 0, {"CPU": 2})["autoscaling_config"]
    assert scaling["metrics_interval_s"] == 0.5
    from ray.serve.config import AutoscalingConfig

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        AutoscalingConfig(**scaling)
    plain = model_replica_options(load_config({}), 0, {"CPU": 2})
    assert "autoscaling_config" not in plain and plain["num_replicas"] == 1


def test_health_check_timing_is_configurable_and_checked():
    default = model_replica_options(load_config({}), 0, {"CPU": 2})
    assert (default["health_check_period_s"], default["health_check_timeout_s"]) == (10, 60)
    config = load_config(
        {"Deployments": {"ModelReplica": {"health_check_period_s": 1, "health_check_timeout_s": 5}}}
    )
    options = model_replica_options(config, 0, {"CPU": 2})
    assert (options["health_check_period_s"], options["health_check_timeout_s"]) == (1, 5)
    assert "health_check_period_s" not in tokenizer_pool_options(config)  # Serve's default there
    with pytest.raises(ConfigError, match=r"Deployments.Decode.health_check_period_s.*> 0"):
        load_config({"Deployments": {"Decode": {"health_check_period_s": 0}}})


def test_drain_placement_and_routing_keys_reach_ray_serve_as_given():
    """Ray Serve's keys for draining a stopping replica, spreading replicas over nodes, placement
    groups and the request router are accepted per deployment and passed on unchanged; a
    placement strategy without bundles is refused, naming the key."""
    options = {
        "graceful_shutdown_wait_loop_s": 0.5, "graceful_shutdown_timeout_s": 600,
        "placement_group_bundles": [{"CPU": 1, "NPU": 1}, {"NPU": 1}],
        "placement_group_strategy": "STRICT_PACK",
        "request_router_config": {"request_router_class": "my.routers:PrefixRouter"},
    }  # fmt: skip
    spread = {"max_replicas_per_node": 1}
    config = load_config({"Deployments": {"ModelReplica": options, "Ingress": spread}})
    assert {k: v for k, v in model_replica_options(config, 0, {"CPU": 2}).items()
            if k in options} == options  # fmt: skip
    assert ingress_options(config)["max_replicas_per_node"] == 1
    with pytest.raises(ConfigError, match=r"Deployments.Prefill.*cannot both be set"):
        load_config({"Deployments": {"Prefill": {**options, **spread}}})
    assert "graceful_shutdown_timeout_s" not in tokenizer_pool_options(config)  # Serve's default
    with pytest.raises(ConfigError, match=r"Deployments.Decode.*placement_group_bundles"):
        load_config({"Deployments": {"Decode": {"placement_group_strategy": "PACK"}}})
    with pytest.raises(ConfigError, match=r"Deployments.Ingress.max_replicas_per_node"):
        load_config({"Deployments": {"Ingress": {"max_replicas_per_node": 0}}})


def test_ingress_and_tokenizer_pool_defaults_follow_mindie_limits():
    config = load_config(
        {"ServerConfig": {"maxLinkNum": 300}, "BackendConfig": {"tokenizerProcessNumber": 3}}
    )
    ingress = ingress_options(config)
    # 300 running + 600 queued are counted inside the replica; Ray's limits leave room above
    assert admission_limits(config) == (300, 600)
    assert ingress["max_ongoing_requests"] >= 900 and ingress["max_queued_requests"] >= 1
    assert ingress["ray_actor_options"]["num_cpus"] == 0
    split = load_config(
        {"ServerConfig": {"maxLinkNum": 301}, "Deployments": {"Ingress": {"num_replicas": 2}}}
    )
    assert admission_limits(split) == (151, 302)  # per ingress replica, rounded up
    pool = tokenizer_pool_options(config)
    assert pool["num_replicas"] == 3 and pool["ray_actor_options"]["num_cpus"] == 0


def test_every_deployment_runs_serves_fast_path_and_user_env_vars_win():
    config = load_config(
        {
            "Deployments": {
                "ModelReplica": {
                    "ray_actor_options": {
                        "runtime_env": {
                            "pip": ["x"],
                            "env_vars": {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "0", "MINE": "1"},
                        }
                    }
                }
            }
        }
    )
    for options in (ingress_options(config), tokenizer_pool_options(config)):
        assert options["ray_actor_options"]["runtime_env"] == {"env_vars": SERVE_FAST_PATH_ENV}
    runtime_env = model_replica_options(config, 0, {"CPU": 2})["ray_actor_options"]["runtime_env"]
    assert runtime_env["pip"] == ["x"]
    assert runtime_env["env_vars"] == {
        **SERVE_FAST_PATH_ENV,
        "RAY_SERVE_USE_GRPC_BY_DEFAULT": "0",
        "MINE": "1",
    }


def test_only_the_ingress_writes_an_access_log_line_per_request_by_default():
    """Ray Serve logs every call in every deployment; the HTTP request's line is the ingress's,
    the deployments behind it log none unless their logging_config asks (merged key by key)."""
    from serve_app.deployment_options import embedding_replica_options, stop_registry_options

    config = load_config({})
    assert "logging_config" not in ingress_options(config)
    for options in (
        tokenizer_pool_options(config),
        model_replica_options(config, 0, {"CPU": 2}),
        model_replica_options(config, 0, {"CPU": 2}, role="decode"),
        embedding_replica_options(config),
        stop_registry_options(config),
    ):
        assert options["logging_config"] == {"enable_access_log": False}
    config = load_config(
        {
            "Deployments": {
                "ModelReplica": {"logging_config": {"enable_access_log": True}},
                "TokenizerPool": {"logging_config": {"log_level": "DEBUG"}},
                "Ingress": {"logging_config": {"encoding": "JSON"}},
            }
        }
    )
    assert model_replica_options(config, 0, {"CPU": 2})["logging_config"] == {
        "enable_access_log": True
    }
    assert tokenizer_pool_options(config)["logging_config"] == {
        "enable_access_log": False,
        "log_level": "DEBUG",
    }
    assert ingress_options(config)["logging_config"] == {"encoding": "JSON"}
    with pytest.raises(ConfigError, match=r"unknown logging_config key.*access_log"):
        load_config({"Deployments": {"Ingress": {"logging_config": {"access_log": False}}}})


def test_model_and_prefill_replicas_are_routed_by_prefix_by_default():
    from serve_app.deployment_options import PREFIX_ROUTER

    config = load_config({"BackendConfig": {"ScheduleConfig": {"cacheBlockSize": 32}}})
    for role in ("colocated", "prefill"):
        router = model_replica_options(config, 0, {"CPU": 2}, role)["request_router_config"]
        assert router["request_router_class"] == PREFIX_ROUTER
        assert router["request_router_kwargs"] == {"block_size": 32}
    assert "request_router_config" not in model_replica_options(config, 0, {"CPU": 2}, "decode")
    off = load_config({"BackendConfig": {"ScheduleConfig": {"enablePrefixCaching": False}}})
    assert "request_router_config" not in model_replica_options(off, 0, {"CPU": 2})
    # Ray Serve's own router where a user names it
    default = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
    mine = load_config({"Deployments": {"ModelReplica": {
        "request_router_config": {"request_router_class": default}}}})  # fmt: skip
    assert model_replica_options(mine, 0, {"CPU": 2})["request_router_config"] == {
        "request_router_class": default
    }
    from serve_app.routing import prefix_router  # the import path Ray Serve resolves

    assert PREFIX_ROUTER == f"{prefix_router.__name__}:{prefix_router.PrefixAwareRouter.__name__}"


# -- num_cpus auto ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cpus, ranks, expect",
    [(1, 1, 1), (2, 1, 1), (4, 1, 3), (16, 1, 14), (16, 2, 7), (192, 8, 21), (2, 2, 0.5),
     (2, 8, 0.25)],
)  # fmt: skip
def test_auto_leaves_the_serving_path_its_cores_and_splits_the_rest(cpus, ranks, expect):
    from serve_app.replica_cpus import share

    assert share(cpus, ranks) == expect


def _models(*models: dict, **deployments) -> object:
    return load_config({
        "BackendConfig": {"ModelDeployConfig": {"ModelConfig": list(models)}},
        "Deployments": deployments,
    })  # fmt: skip


def test_auto_sizes_model_replicas_to_the_node_and_explicit_values_win():
    one = {"modelName": "a", "modelWeightPath": "demo", "device": "cpu"}
    two = {**one, "modelName": "b"}
    sixteen = {"CPU": 16}

    def cpus(config, index=0, resources=sixteen, role="colocated"):
        return model_replica_options(config, index, resources, role)["ray_actor_options"][
            "num_cpus"
        ]

    assert cpus(_models(one)) == 14  # most of a 16-core node
    assert cpus(_models(one), resources={"CPU": 2}) == 1  # as before on 2 cores
    # two CPU models, or two replicas of one, share the node
    assert cpus(_models(one, two)) == cpus(_models(one, two), 1) == 7
    assert cpus(_models(one, ModelReplica={"num_replicas": 2})) == 7
    scaled = {"num_replicas": "auto", "autoscaling_config": {"max_replicas": 4}}
    assert cpus(_models(one, ModelReplica=scaled)) == 3.5
    # a model on the NPU does not count among the CPU ones: its node's NPUs share that node
    npu = {**two, "device": "npu"}
    assert cpus(_models(one, npu)) == 14
    assert cpus(_models(one, npu), 1, {"CPU": 64, "NPU": 8}) == 7
    # PD on CPU: the prefill and the decode replicas share the node
    pd = load_config({
        "ServerConfig": {"inferMode": "dmi"},
        "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [one]}},
    })  # fmt: skip
    assert cpus(pd, role="prefill") == cpus(pd, role="decode") == 7
    # explicit values are kept as given
    for given in (0, 0.5, 3):
        actor = {"ray_actor_options": {"num_cpus": given}}
        assert cpus(_models(one, ModelReplica=actor)) == given
    assert cpus(_models(one, ModelReplica={"ray_actor_options": {"num_cpus": "auto"}})) == 14


def test_auto_asks_the_live_cluster_for_its_smallest_node_that_fits(monkeypatch):
    from serve_app import deployment_options, replica_cpus

    nodes = [{"CPU": 8}, {"CPU": 32, "NPU": 8}, {"CPU": 16, "NPU": 8}, {"CPU": 0, "NPU": 4}]
    monkeypatch.setattr(replica_cpus, "live_nodes", lambda: nodes)
    monkeypatch.setattr(deployment_options, "_most_per_node", lambda key: 8)
    npu = _models({"modelWeightPath": "demo", "device": "npu", "worldSize": 2})
    # the 16-CPU node of 8 NPUs: 2 kept, 14 over 8 ranks
    options = model_replica_options(npu, 0)
    assert options["ray_actor_options"]["num_cpus"] == 1.75
    assert options["placement_group_bundles"] == [{"CPU": 1.75, "NPU": 1}] * 2
    # CPU models spread over the three nodes with CPUs: one rank a node, the 8-CPU one smallest
    cpu = _models(*({"modelName": m, "modelWeightPath": "demo", "device": "cpu"} for m in "abc"))
    assert model_replica_options(cpu, 0)["ray_actor_options"]["num_cpus"] == 7


def test_num_cpus_auto_is_for_model_replicas_and_other_values_are_refused():
    for name in ("Ingress", "TokenizerPool", "EmbeddingReplica"):
        with pytest.raises(ConfigError, match=rf"Deployments.{name}.* model replicas"):
            load_config({"Deployments": {name: {"ray_actor_options": {"num_cpus": "auto"}}}})
    for bad in (-1, "many", True):
        with pytest.raises(ConfigError, match="num_cpus must be a number >= 0 or 'auto'"):
            load_config({"Deployments": {"Decode": {"ray_actor_options": {"num_cpus": bad}}}})


def test_the_ready_line_says_the_node_size_and_the_cpus_ray_reserved(monkeypatch):
    import ray

    from serve_app.replica_cpus import node_cores, sizing_note

    assert sizing_note(False) == ""  # outside Ray, nothing auto: nothing to say
    assert sizing_note(True) == f" (auto-sized to a {len(node_cores())}-core node)"

    class Context:
        def get_assigned_resources(self):
            return {"CPU": 14.0, "NPU": 1.0}

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", Context)
    assert sizing_note(False) == " (14 CPUs reserved from Ray)"
    assert sizing_note(True).endswith("-core node; 14 CPUs reserved from Ray)")
