"""Resolve modelWeightPath to a local HF folder (a hub id is fetched first: models/hub.py) and
load its tokenizer and model from that folder, offline."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from serve_app.models import minilm, smollm2
from serve_app.models.cache import cache_root, noted_tokenizer_class
from serve_app.models.demo import DEMO_VARIANTS, ensure_demo_model, model_config
from serve_app.models.hub import parse_hub_id, resolve_hub_id

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase


# modelWeightPath names of the built-in models: the generative ones are built into the model
# cache on first use; the embedding model is read from its installed package as it is
BUILT_IN = (smollm2.NAME, *DEMO_VARIANTS, minilm.NAME)


def resolve_model_path(model_weight_path: str) -> Path:
    """The folder of a built-in model (built into the cache first if need be); else an existing
    folder holding config.json; else, for a Hugging Face hub id ('owner/name[@revision]') that
    is no local path, its snapshot in the Hugging Face cache (downloaded first if need be, once
    per process). FileNotFoundError, naming modelWeightPath, when there is none of these."""
    if model_weight_path in DEMO_VARIANTS:
        return ensure_demo_model(model_weight_path)
    if model_weight_path == smollm2.NAME:
        return smollm2.ensure()
    if model_weight_path == minilm.NAME:
        return minilm.path()
    path = Path(model_weight_path).expanduser()
    # a local path wins over a hub id of the same spelling ('models/qwen' in the working folder)
    if not path.exists() and parse_hub_id(model_weight_path):
        return resolve_hub_id(model_weight_path)
    if not (path / "config.json").is_file():
        problem = "has no config.json" if path.is_dir() else "does not exist"
        raise FileNotFoundError(
            f"modelWeightPath {model_weight_path!r} {problem}: expected a folder of HF weights "
            "(config.json, *.safetensors, tokenizer files), a Hugging Face hub id "
            f"(owner/name[@revision]) or one of {', '.join(BUILT_IN)}"
        )
    return path.absolute()


def config_on_disk(model_weight_path: str) -> PretrainedConfig | None:
    """The model's HF config where reading it fetches and builds nothing: a demo variant's, the
    converted SmolLM2's, a local folder's; None otherwise (a hub id, a model not built yet):
    the checks that need it then run as the model loads."""
    from transformers import AutoConfig

    if model_weight_path in DEMO_VARIANTS:
        values = model_config(model_weight_path)
        return AutoConfig.for_model(values.pop("model_type"), **values)
    if model_weight_path == minilm.NAME:
        return None
    if model_weight_path == smollm2.NAME:
        folder = cache_root() / f"{smollm2.NAME}-v{smollm2.FORMAT_VERSION}"
    else:
        folder = Path(model_weight_path).expanduser()
    if not (folder / "config.json").is_file():
        return None
    return load_config(folder)


def load_config(path: str | Path) -> PretrainedConfig:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """AutoTokenizer's tokenizer for the folder; for a folder the model cache built, the class
    AutoTokenizer chose when it was built, loaded without reading the model's config (which
    imports torch)."""
    import transformers

    noted = noted_tokenizer_class(Path(path))
    loader = getattr(transformers, noted or "", None) or transformers.AutoTokenizer
    return loader.from_pretrained(str(path), local_files_only=True)


def tokenizer_eos_ids(tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    """The tokenizer's end-of-sequence id, as a set (empty without one)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return set() if eos is None else {eos}


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model.to(device).eval()
