"""Device and dtype choice: `device: auto` picks npu, then cuda, then cpu."""

from __future__ import annotations

import functools
import importlib.util

import torch


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())


def pick_device(name: str = "auto", rank: int = 0) -> torch.device:
    """The device `name` names; with several visible (the ranks of one model on one machine,
    outside Ray, which shows each rank its own), the rank's."""
    if name == "auto":
        if npu_available():
            name = "npu"
        elif torch.cuda.is_available():
            name = "cuda"
        else:
            name = "cpu"
    if name == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
    if name in ("npu", "cuda"):
        devices = getattr(torch, name)  # torch.npu / torch.cuda
        index = rank if devices.device_count() > rank else devices.current_device()
        return torch.device(name, index)
    return torch.device("cpu")


def check_local_ranks(device: torch.device, world: int) -> None:
    """Ranks started as this machine's processes (no Ray to show each its own device) take
    devices 0..world-1 of `device`'s type: refuse a world size beyond what this process sees,
    rather than put two ranks on one device (which NCCL and HCCL refuse, obscurely)."""
    if device.type not in ("cuda", "npu"):
        return  # CPU ranks share the host
    count = getattr(torch, device.type).device_count()  # torch.cuda / torch.npu
    if count < world:
        raise ValueError(
            f"worldSize {world} needs {world} {device.type} devices, one a rank; this process "
            f"sees {count} (set CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES, or a smaller "
            "worldSize)"
        )


@functools.cache
def cpu_flags() -> str:
    """The CPU's feature flags: /proc/cpuinfo's first `flags` (x86) or `Features` (Arm) line,
    read once; "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")


def cpu_has_fast_bf16() -> bool:
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_amx_bf16() -> bool:
    """Intel's AMX tiles with bfloat16 (Sapphire Rapids and later): oneDNN multiplies bfloat16
    there in tile instructions, many times the rate of vector dot products."""
    return "amx_bf16" in cpu_flags()


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type in ("npu", "cuda") or cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "npu":
        return torch.npu.mem_get_info(device)[0]
    return 2 << 30  # CPU: a 2 GiB KV pool unless the config says otherwise
