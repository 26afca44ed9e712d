"""Load one rank's part of a model: only its slices of the split weights are read.

A model split over N devices is one that does not fit one of them, nor, N times over, the host's
memory. So a rank does not load the whole checkpoint and slice it: it builds the model's
skeleton with its weights on the meta device (accelerate's `init_empty_weights`; buffers such
as the rotary frequencies are computed as usual), then reads each weight from the safetensors
files straight onto its device, a split weight as the slice `plan.parts` names (safetensors
reads a slice from the file without reading the rest). The embeddings, norms and LM head are
read whole on every rank (plan.py).

A checkpoint this cannot read that way (no safetensors files, or names that do not match the
model's, as some architectures rename theirs on load) is loaded whole on the host and sliced
there before anything goes to the device: the device still holds only the rank's part.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from serve_app.engine.backends.parallel import plan
from serve_app.engine.backends.parallel.plan import Split
from serve_app.models.loader import load_model

log = logging.getLogger(__name__)


def _checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def _skeleton(folder: Path, dtype: torch.dtype):
    """The model with every parameter on the meta device (no memory), buffers real."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _read_parts(model, files: list[Path], split: Split, dtype, device) -> list[str]:
    """Fill the skeleton's parameters from the files (split ones as this rank's part); the
    names of those still on the meta device after (empty: all read)."""
    wanted = plan.parts(model, split)
    params = dict(model.named_parameters())  # tied weights once, by their first name
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if name not in params:
                    continue  # a tied copy, or what the model computes itself
                part = wanted.get(name)
                if part is not None and part.count == 0:
                    plan.set_part(model, name, None)
                    continue
                tensor = part.take(f.get_slice(name)) if part else f.get_tensor(name)
                plan.set_part(model, name, tensor.to(device=device, dtype=dtype))
    model.tie_weights()
    return [name for name, p in model.named_parameters() if p.is_meta]


def load_part(path: str | Path, dtype: torch.dtype, device: torch.device, split: Split):
    """The model with `split`'s rank's part of every split weight, on `device`, in eval mode."""
    folder = Path(path)
    files = _checkpoint_files(folder)
    if files:
        model = _skeleton(folder, dtype)
        missing = _read_parts(model, files, split, dtype, device)
        if not missing:
            return model.to(device).eval()  # (the buffers: the parameters are there already)
        log.warning(
            "%s: %d weights (e.g. %s) are not in its safetensors files under the model's names: "
            "loading the whole model on the host to split it",
            folder, len(missing), missing[0],
        )  # fmt: skip
    model = load_model(folder, dtype, torch.device("cpu"))
    plan.apply(model, split)
    return model.to(device)
