"""Model replicas: the deployments that hold an engine on one accelerator.

Place in the request path: the ingress has already turned the request into prompt token ids (via
the tokenizer pool) and sends a `ReplicaRequest` here; the replica runs it through its
`AsyncEngine`, detokenizes incrementally and applies stop strings next to the engine (so a stop
string ends generation at the exact step), and streams `ReplicaChunk`s back to the ingress. Like
every deployment, `ModelReplica` is a plain class; only the app builder decorates and binds it.

`EmbeddingReplica` (embedding_replica.py) is the embedding endpoints' deployment: an encoder on
CPU that answers an `EmbedRequest` with vectors, gathering concurrent requests into one pass.
"""
