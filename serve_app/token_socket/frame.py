"""The token socket's frames (`token_socket/inbox.py`, `token_socket/outbox.py`): a header,
the byte length, then one engine step's chunks of a replica for one ingress, pickled.

Pickling a chunk as objects calls back into Python for each of its three, on the replica's
event loop, for every stream every step. A streamed chunk of one choice and one step with
nothing but its tokens, text and timing crosses as a tuple of plain values instead, which pickle
writes without calling Python; any other chunk as itself.
"""

from __future__ import annotations

import struct

from serve_app.messages import ChoiceDelta, ReplicaChunk, StepInfo

TOKEN_FRAME = struct.Struct("!I")


def pack_chunks(chunks: list[ReplicaChunk]) -> list[ReplicaChunk | tuple]:
    """The chunks of one frame, each streamed one as a tuple (`unpack_chunks` undoes it)."""
    packed: list[ReplicaChunk | tuple] = []
    for chunk in chunks:
        if len(chunk.choices) == len(chunk.steps) == 1 and _plain(chunk, chunk.choices[0]):
            c, step = chunk.choices[0], chunk.steps[0]
            packed.append(
                (chunk.request_id, chunk.num_prompt_tokens, chunk.replica_id, c.index,
                 c.token_ids, c.text, c.num_output_tokens, c.cumulative_logprob,
                 step.batch_size, step.queue_wait_us, step.prefill_time_ms, step.decode_time_ms)
            )  # fmt: skip
        else:
            packed.append(chunk)
    return packed


def _plain(chunk: ReplicaChunk, c: ChoiceDelta) -> bool:
    """Whether a chunk of one choice holds nothing but what `pack_chunks` keeps."""
    return (
        not chunk.finished
        and chunk.error is None
        and chunk.error_kind is None
        and chunk.stats is None
        and chunk.handoff_ms is None
        and not chunk.kv_bytes
        and not chunk.kv_recomputed
        and c.token_texts is None
        and c.logprobs is None
        and c.finish_reason is None
        and c.stop_reason is None
    )


def unpack_chunks(packed: list[ReplicaChunk | tuple]) -> list[ReplicaChunk]:
    """`pack_chunks`' chunks as they were."""
    chunks = []
    for item in packed:
        if type(item) is not tuple:
            chunks.append(item)
            continue
        rid, prompt, replica, index, tokens, text, n, cumulative, *step = item
        choice = ChoiceDelta(
            index, tokens, text, num_output_tokens=n, cumulative_logprob=cumulative
        )
        chunks.append(
            ReplicaChunk(rid, [choice], [StepInfo(*step)], num_prompt_tokens=prompt,
                         replica_id=replica)
        )  # fmt: skip
    return chunks
