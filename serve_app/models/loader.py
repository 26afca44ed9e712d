"""Resolve modelWeightPath to a local HF folder and load its tokenizer and model, offline."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from serve_app.models import smollm2
from serve_app.models.demo import DEMO_VARIANTS, ensure_demo_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


# modelWeightPath names of the built-in models, built into the model cache on first use
BUILT_IN = (smollm2.NAME, *DEMO_VARIANTS)


def resolve_model_path(model_weight_path: str) -> Path:
    """The cached build of a built-in model; otherwise a folder holding config.json."""
    if model_weight_path in DEMO_VARIANTS:
        return ensure_demo_model(model_weight_path)
    if model_weight_path == smollm2.NAME:
        return smollm2.ensure()
    path = Path(model_weight_path).expanduser()
    if not (path / "config.json").is_file():
        problem = "has no config.json" if path.is_dir() else "does not exist"
        raise FileNotFoundError(
            f"modelWeightPath {model_weight_path!r} {problem}: expected a folder of HF weights "
            f"(config.json, *.safetensors, tokenizer files) or one of {', '.join(BUILT_IN)}"
        )
    return path.absolute()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model.to(device).eval()
