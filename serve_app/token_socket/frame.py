"""The token socket's frames (`token_socket/inbox.py`, `token_socket/outbox.py`): a header,
the byte length, then one engine step's chunks of a replica for one ingress, pickled, each chunk
in its flat form (`serve_app.wire`): pickle writes a tuple of plain values without calling back
into Python, on the replica's event loop, for every stream every step.
"""

from __future__ import annotations

import struct

from serve_app.messages import ReplicaChunk
from serve_app.wire import flat

TOKEN_FRAME = struct.Struct("!I")

_pack_chunk, _unpack_chunk = flat(ReplicaChunk)


def pack_chunks(chunks: list[ReplicaChunk]) -> list[tuple]:
    """The chunks of one frame, each in its flat form (`unpack_chunks` undoes it)."""
    return [_pack_chunk(chunk) for chunk in chunks]


def unpack_chunks(packed: list[tuple]) -> list[ReplicaChunk]:
    """`pack_chunks`' chunks as they were."""
    return [_unpack_chunk(item) for item in packed]
