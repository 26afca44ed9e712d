"""Device and dtype choice: `device: auto` picks npu, then cuda, then cpu."""

from __future__ import annotations

import importlib.util

import torch


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        if npu_available():
            name = "npu"
        elif torch.cuda.is_available():
            name = "cuda"
        else:
            name = "cpu"
    if name == "npu":
        import torch_npu  # noqa: F401

        return torch.device("npu", torch.npu.current_device())
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_has_fast_bf16() -> bool:
    flags = _cpuinfo()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_amx_bf16() -> bool:
    """Intel's AMX tiles with bfloat16 (Sapphire Rapids and later): oneDNN multiplies bfloat16
    there in tile instructions, many times the rate of vector dot products."""
    return "amx_bf16" in _cpuinfo()


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
