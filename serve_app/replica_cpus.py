"""The CPUs a model replica reserves from Ray: `ray_actor_options.num_cpus: auto` (the default of
the ModelReplica, Prefill and Decode deployments).

Ray places a replica only where its `num_cpus` is free and gives its process that many torch
threads; the engine's own cores are bound on the node itself (ModelConfig `engineCpus auto`).
`auto` reserves what those cores are: of a node's n CPUs the serving path (ingress, tokenizer
pool, Ray) keeps max(1, n // 8), as engineCpus auto leaves it, and the model ranks that share the
node split the rest. Which ranks share a node: on NPU or CUDA one per device of the node; on CPU
the app's CPU model ranks spread evenly over the nodes. Each rank gets at least 0.25. The node is
the smallest one that could take the replica (alive, with the device), asked of the running Ray
cluster when the app is built; without Ray, this machine. So one model on a 2-core machine
reserves 1 CPU, as before, and on a 16-core node 14; eight NPU ranks on a 192-core node 21 each.
"""

from __future__ import annotations

import glob
import math
from typing import Any

from serve_app.placement import AUTO, kept_for_serving, node_cores

DEVICE_RESOURCE = {"npu": "NPU", "cuda": "GPU"}
NPU_DEVICE_FILES = "/dev/davinci[0-9]*"  # one per Ascend NPU the machine shows
MIN_SHARE = 0.25


def share(node_cpus: float, ranks_on_node: int) -> float:
    """A rank's CPUs on a node of node_cpus CPUs that ranks_on_node model ranks share."""
    n = int(node_cpus)
    usable = n - kept_for_serving(n) if n >= 2 else max(n, 1)
    per_rank = math.floor(usable / max(1, ranks_on_node) * 100) / 100
    return max(MIN_SHARE, per_rank)


def live_nodes() -> list[dict[str, float]] | None:
    """The resources of each live node of the Ray cluster (None: Ray is not up here)."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
    except Exception:  # noqa: BLE001 (no cluster to ask: this machine's numbers)
        return None


def _this_machine(device: str) -> list[dict[str, float]]:
    found: dict[str, float] = {"CPU": float(len(node_cores()))}
    if device == "npu":
        found["NPU"] = float(len(glob.glob(NPU_DEVICE_FILES)))
    elif device == "cuda":
        try:
            import torch

            found["GPU"] = float(torch.cuda.device_count())
        except Exception:  # noqa: BLE001 (no torch CUDA here: one device assumed)
            found["GPU"] = 1.0
    return [found]


def auto_num_cpus(
    device: str, world: int, cpu_ranks: int, nodes: list[dict[str, float]] | None = None
) -> float:
    """num_cpus of each rank of a replica on `device` ('npu', 'cuda', 'cpu') for `auto`;
    cpu_ranks: the ranks of the app's CPU model replicas, all together; nodes: each node's
    resources (default: the live Ray cluster's, else this machine's)."""
    nodes = nodes if nodes is not None else (live_nodes() or _this_machine(device))
    key = DEVICE_RESOURCE.get(device)
    if key:
        fits = [n for n in nodes if n.get(key, 0) > 0 and n.get("CPU", 0) > 0]
        shares = [share(n["CPU"], max(world, int(n[key]))) for n in fits]
    else:
        fits = [n for n in nodes if n.get("CPU", 0) > 0]
        per_node = max(world, math.ceil(cpu_ranks / max(1, len(fits))))
        shares = [share(n["CPU"], per_node) for n in fits]
    return min(shares, default=1.0)


def replicas_of(options: dict[str, Any]) -> int:
    """The replicas a deployment may run at once: num_replicas, or with autoscaling its
    max_replicas (1 when not given)."""
    count = options.get("num_replicas")
    if isinstance(count, int):
        return count
    return int((options.get("autoscaling_config") or {}).get("max_replicas", 1))


def is_auto(actor: dict[str, Any]) -> bool:
    return str(actor.get("num_cpus", AUTO)).lower() == AUTO


def sizing_note(engine_cores_auto: bool) -> str:
    """For a replica's ready line: the node size engineCpus auto went by, and the CPUs Ray
    reserved for this replica (' (auto-sized to a 16-core node; 14 CPUs reserved from Ray)')."""
    notes = [f"auto-sized to a {len(node_cores())}-core node"] if engine_cores_auto else []
    try:
        import ray

        if ray.is_initialized():
            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
            if cpus is not None:
                notes.append(f"{cpus:g} CPU{'' if cpus == 1 else 's'} reserved from Ray")
    except Exception:  # noqa: BLE001 (outside a Ray worker: nothing reserved to report)
        pass
    return f" ({'; '.join(notes)})" if notes else ""
