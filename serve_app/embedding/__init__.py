"""Sentence embeddings: a BERT-style encoder and the micro-batching that feeds it.

Place in the request path: an embedding deployment (`replica/embedding_replica.py`) holds one
`Encoder` and answers `EmbedRequest`s; concurrent requests are gathered by a `MicroBatcher` so
that many small requests share forward passes. Like the engine, this package imports no
fastapi, pydantic or ray: it is plain torch and transformers, usable and testable offline.

    encoder.py  Encoder: texts -> L2-normalised mean-pooled vectors and token counts
    batcher.py  MicroBatcher: concurrent calls gathered into one batch on a worker thread
"""

from serve_app.embedding.batcher import MicroBatcher

__all__ = ["Encoder", "InputRefused", "MicroBatcher"]


def __getattr__(name: str):
    """The encoder's names, imported when first used: torch and transformers then load, not
    where the app is only built (the builder imports the replica's class)."""
    if name in ("Encoder", "InputRefused"):
        from serve_app.embedding import encoder

        return getattr(encoder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
