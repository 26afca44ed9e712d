"""cluster/: the Ascend cluster files parse, point at the real app, and their args load.

No Ray is started: the launcher config goes through Ray's own config preparation and schema, the
Serve configs through `ServeDeploySchema`, and start-node.sh runs with --dry-run against a fake
`npu-smi` on PATH.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from serve_app.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"
LAUNCHER = CLUSTER / "ascend-cluster.yaml"
SERVE_PD = CLUSTER / "serve-pd.yaml"
SERVE_TP = CLUSTER / "serve-tp.yaml"
RAYSERVICE = CLUSTER / "kuberay-rayservice.yaml"
START_NODE = CLUSTER / "start-node.sh"
IMPORT_PATH = "serve_app.app:build_app"
PD_KEYS = ("Prefill", "Decode")

# `npu-smi info -l` on an 8-card Atlas 800 (one chip per card), shortened.
NPU_SMI_8 = "\n".join(
    ["        Total Count                    : 8", ""]
    + [
        line
        for npu in range(8)
        for line in (
            f"        NPU ID                         : {npu}",
            "        Product Name                   : Ascend910",
            "        Chip Count                     : 1",
            "",
        )
    ]
)


def _yaml(path: Path):
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _rayservice_serve_config() -> dict:
    text = _yaml(RAYSERVICE)["spec"]["serveConfigV2"]
    assert isinstance(text, str), "serveConfigV2 must be a YAML string"
    return yaml.safe_load(text)


def _app(serve_config: dict) -> dict:
    (app,) = serve_config["applications"]
    return app


def _load_args(args: dict):
    """load_config(args); skip only when the PD deployment keys are all it refuses."""
    try:
        return load_config(args)
    except ConfigError as exc:
        problems = str(exc).splitlines()[1:]
        only_pd_keys = problems and all(
            "unknown key" in line
            and any(line.strip().startswith(f"Deployments.{key}:") for key in PD_KEYS)
            for line in problems
        )
        if not only_pd_keys:
            raise
        rest = dict(
            args, Deployments={k: v for k, v in args["Deployments"].items() if k not in PD_KEYS}
        )
        load_config(rest)  # everything else must load already
        pytest.skip("Deployments.Prefill/Decode not in config yet")


@pytest.mark.parametrize("path", sorted(CLUSTER.glob("*.yaml")), ids=lambda p: p.name)
def test_yaml_parses(path):
    assert isinstance(_yaml(path), dict)


def test_expected_files_exist():
    assert {p.name for p in CLUSTER.iterdir()} >= {
        LAUNCHER.name,
        SERVE_PD.name,
        SERVE_TP.name,
        RAYSERVICE.name,
        START_NODE.name,
    }


def test_launcher_passes_rays_own_checks():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _yaml(LAUNCHER)
    assert config["provider"]["type"] == "local"
    assert {"head_ip", "worker_ips"} <= set(config["provider"])
    validate_config(prepare_config(config))


def test_launcher_sets_up_cann_and_starts_nodes_with_the_script():
    config = _yaml(LAUNCHER)
    setup = "\n".join(config["setup_commands"])
    assert "/usr/local/Ascend/ascend-toolkit/set_env.sh" in setup
    assert "pip install -e '.[ascend]'" in setup
    head, workers = config["head_start_ray_commands"], config["worker_start_ray_commands"]
    assert any("cluster/start-node.sh head" in cmd for cmd in head)
    assert any("cluster/start-node.sh worker --head-address $RAY_HEAD_IP" in c for c in workers)


def test_launcher_deploys_the_pd_app():
    deploys = [cmd for cmd in _yaml(LAUNCHER)["head_start_ray_commands"] if "serve deploy" in cmd]
    assert deploys and all("cluster/serve-pd.yaml" in cmd for cmd in deploys)
    assert _app(_yaml(SERVE_PD))["import_path"] == IMPORT_PATH
    text = LAUNCHER.read_text(encoding="utf-8")
    assert "ray up cluster/ascend-cluster.yaml" in text
    assert IMPORT_PATH in text


def test_rayservice_references_the_app():
    manifest = _yaml(RAYSERVICE)
    assert manifest["apiVersion"] == "ray.io/v1"
    assert manifest["kind"] == "RayService"
    assert _app(_rayservice_serve_config())["import_path"] == IMPORT_PATH


def test_rayservice_workers_request_and_advertise_one_npu():
    cluster = _yaml(RAYSERVICE)["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert "resources" not in head["rayStartParams"]
    for container in head["template"]["spec"]["containers"]:
        assert "huawei.com/Ascend910" not in str(container.get("resources"))
    (group,) = cluster["workerGroupSpecs"]
    # KubeRay pastes the value into a shell command: it must be one quoted JSON word
    (word,) = shlex.split(group["rayStartParams"]["resources"])
    assert json.loads(word) == {"NPU": 1}
    (container,) = group["template"]["spec"]["containers"]
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["huawei.com/Ascend910"] == 1
    assert "ascend-toolkit/set_env.sh" in " ".join(container["args"])
    assert "$KUBERAY_GEN_RAY_START_CMD" in " ".join(container["args"])
    assert group["template"]["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"


def test_rayservice_has_enough_npu_pods_for_the_replicas():
    deployments = _app(_rayservice_serve_config())["args"]["Deployments"]
    needed = sum(
        deployments[key]["num_replicas"] * deployments[key]["ray_actor_options"]["resources"]["NPU"]
        for key in PD_KEYS
    )
    (group,) = _yaml(RAYSERVICE)["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["replicas"] >= needed


def test_rayservice_serves_the_same_app_as_serve_pd():
    assert _app(_rayservice_serve_config())["args"] == _app(_yaml(SERVE_PD))["args"]


@pytest.mark.parametrize("source", ["serve-pd.yaml", "serveConfigV2"])
def test_application_args_load(source):
    serve_config = _yaml(SERVE_PD) if source == "serve-pd.yaml" else _rayservice_serve_config()
    app = _app(serve_config)
    assert app["import_path"] == IMPORT_PATH
    config = _load_args(app["args"])
    assert config.ServerConfig.inferMode == "dmi"
    (model,) = config.BackendConfig.ModelDeployConfig.ModelConfig
    assert (model.modelName, model.modelWeightPath) == ("qwen2.5-7b", "/models/Qwen2.5-7B-Instruct")
    assert (model.worldSize, model.device) == (1, "npu")
    prefill, decode = (getattr(config.Deployments, key) for key in PD_KEYS)
    assert (prefill.num_replicas, decode.num_replicas) == (1, 2)
    assert prefill.ray_actor_options["resources"] == decode.ray_actor_options["resources"]


@pytest.mark.parametrize("source", ["serve-pd.yaml", "serveConfigV2"])
def test_ray_serve_accepts_the_config(source):
    from ray.serve.schema import ServeDeploySchema

    serve_config = _yaml(SERVE_PD) if source == "serve-pd.yaml" else _rayservice_serve_config()
    schema = ServeDeploySchema.model_validate(serve_config)
    assert schema.applications[0].import_path == IMPORT_PATH


def test_the_tensor_parallel_example_splits_its_model_over_four_npus_of_one_node(monkeypatch):
    """serve-tp.yaml: a 32B model over 4 NPUs a replica (the heads of Qwen2.5-32B, whose
    config.json is not here, divide by 4), two replicas of 4 on an 8-NPU node."""
    from ray.serve.schema import ServeDeploySchema

    from serve_app import deployment_options, replica_cpus
    from serve_app.deployment_options import model_replica_options

    serve_config = _yaml(SERVE_TP)
    ServeDeploySchema.model_validate(serve_config)
    app = _app(serve_config)
    assert app["import_path"] == IMPORT_PATH
    config = _load_args(app["args"])
    (model,) = config.BackendConfig.ModelDeployConfig.ModelConfig
    assert (model.worldSize, model.device, model.dtype) == (4, "npu", "bfloat16")
    heads, kv_heads, mlp = 40, 8, 27648  # Qwen2.5-32B-Instruct's config.json
    assert heads % 4 == kv_heads % 4 == mlp % 4 == 0
    # an 8-NPU node of 32 CPUs, as 910B servers come
    monkeypatch.setattr(replica_cpus, "live_nodes", lambda: [{"CPU": 32, "NPU": 8}])
    monkeypatch.setattr(deployment_options, "_most_per_node", lambda key: 8)
    options = model_replica_options(config, 0)
    bundles = options["placement_group_bundles"]
    assert len(bundles) == 4 and all(bundle["NPU"] == 1 for bundle in bundles)
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["num_replicas"] == 2  # 8 NPUs in all


@pytest.mark.parametrize("name", ["deployments.yaml", "deployments-pd.yaml", "bench/demo.yaml"])
def test_the_shipped_serve_configs_validate_and_load(name):
    """The README's `serve run` / `serve deploy` files and the benchmark's: Ray Serve's own
    schema accepts them and their args load through our config model."""
    from ray.serve.schema import ServeDeploySchema

    serve_config = _yaml(ROOT / name)
    schema = ServeDeploySchema.model_validate(serve_config)
    (app,) = schema.applications
    assert app.import_path == IMPORT_PATH and app.route_prefix == "/"
    config = _load_args(serve_config["applications"][0]["args"])
    embedding = [] if name.startswith("bench/") else ["all-minilm-l6-v2"]  # benchmarks: LLM only
    assert config.model_names and config.embedding_names == embedding
    assert config.ServerConfig.apiKeys == ()  # no key shipped in a file


# start-node.sh


@pytest.fixture
def fake_path(tmp_path):
    """A PATH whose `npu-smi info -l` reports 8 NPUs; CANN's set_env.sh is pointed elsewhere."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    npu_smi = bin_dir / "npu-smi"
    npu_smi.write_text(f"#!/bin/sh\ncat <<'EOF'\n{NPU_SMI_8}\nEOF\n")
    npu_smi.chmod(0o755)
    return bin_dir


def _start_node(
    bin_dir: Path | None, *args: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    path = f"{bin_dir}:/usr/bin:/bin" if bin_dir else "/usr/bin:/bin"
    env = {"PATH": path, "CANN_ENV": "/nonexistent/set_env.sh", "HOME": "/tmp", **(env or {})}
    return subprocess.run(
        ["bash", str(START_NODE), *args], capture_output=True, text=True, env=env, timeout=10
    )


def _ray_start(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout)
    assert words[:3] == ["RAY_AUTH_MODE=token", "ray", "start"]  # the CLI's mode made explicit
    return words[1:]


def _resources(words: list[str]) -> dict | None:
    if "--resources" not in words:
        return None
    return json.loads(words[words.index("--resources") + 1])


def test_start_node_syntax():
    subprocess.run(["bash", "-n", str(START_NODE)], check=True, timeout=10)


def test_start_node_detects_npus(fake_path):
    result = _start_node(fake_path, "worker", "--head-address", "10.0.0.1:6379", "--dry-run")
    words = _ray_start(result)
    assert '"NPU": 8' in result.stdout
    assert _resources(words) == {"NPU": 8}
    assert "--address=10.0.0.1:6379" in words


def test_start_node_npus_override(fake_path):
    words = _ray_start(
        _start_node(fake_path, "worker", "--head-address", "h:6379", "--npus", "2", "--dry-run")
    )
    assert _resources(words) == {"NPU": 2}


def test_start_node_head(fake_path):
    words = _ray_start(_start_node(fake_path, "head", "--dry-run", "--", "--num-cpus=4"))
    assert words[2] == "--head" and "--port=6379" in words
    assert _resources(words) == {"NPU": 8}
    assert words[-1] == "--num-cpus=4"


def test_start_node_head_without_npus_advertises_none():
    words = _ray_start(_start_node(None, "head", "--dry-run"))
    assert _resources(words) is None
    words = _ray_start(_start_node(None, "head", "--npus", "0", "--dry-run"))
    assert _resources(words) == {"NPU": 0}


def test_a_worker_without_the_heads_token_is_refused_with_the_fix(fake_path, tmp_path):
    args = ("worker", "--head-address", "h:6379")
    home = {"HOME": str(tmp_path)}  # no ~/.ray/auth_token
    result = _start_node(fake_path, *args, env=home)
    assert result.returncode == 2 and "copy the head's ~/.ray/auth_token" in result.stderr
    dry = _start_node(fake_path, *args, "--dry-run", env=home)
    assert dry.returncode == 0 and "warning: token authentication is on" in dry.stderr
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t" * 32)
    assert "warning" not in _start_node(fake_path, *args, "--dry-run", env=home).stderr
    off = _start_node(fake_path, *args, "--dry-run", env={**home, "RAY_AUTH_MODE": "disabled"})
    assert shlex.split(off.stdout)[0] == "RAY_AUTH_MODE=disabled" and not off.stderr


def test_a_head_without_a_token_generates_the_clusters_token(fake_path, tmp_path):
    # `ray start` with RAY_AUTH_MODE=token refuses to start where no token exists, and never
    # writes one: the head's start makes it (a fake `ray` here, writing where Ray writes)
    ray = fake_path / "ray"
    ray.write_text(
        '#!/bin/sh\nif [ "$1" = get-auth-token ] && [ "$2" = --generate ]; then\n'
        '  mkdir -p "$HOME/.ray"; echo generated > "$HOME/.ray/auth_token"; echo generated\n'
        'else echo "ray $*"; fi\n'
    )
    ray.chmod(0o755)
    home = {"HOME": str(tmp_path)}
    dry = _start_node(fake_path, "head", "--dry-run", env=home)
    assert "would generate the cluster's token" in dry.stderr and _ray_start(dry)
    assert not (tmp_path / ".ray").exists()
    started = _start_node(fake_path, "head", env=home)
    assert started.returncode == 0 and started.stdout.startswith("ray start --head"), started
    assert (tmp_path / ".ray" / "auth_token").read_text() == "generated\n"
    assert "copy it to each worker node" in started.stderr
    again = _start_node(fake_path, "head", env=home)  # a token there is kept
    assert again.returncode == 0 and "generated" not in again.stderr
    named = _start_node(fake_path, "head", env={**home, "RAY_AUTH_TOKEN_PATH": "/nonexistent/t"})
    assert named.returncode == 2 and "RAY_AUTH_TOKEN_PATH names /nonexistent/t" in named.stderr


@pytest.mark.parametrize(
    "args",
    [(), ("nope",), ("worker", "--dry-run"), ("head", "--npus", "x", "--dry-run")],
    ids=["no-role", "bad-role", "worker-no-head", "bad-npus"],
)
def test_start_node_rejects_bad_arguments(fake_path, args):
    result = _start_node(fake_path, *args)
    assert result.returncode == 2
    assert result.stdout == ""
