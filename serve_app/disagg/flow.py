"""One request through a prefill replica and then a decode replica (inferMode dmi).

    tokenizer pool -> prefill replica: runs the prompt, samples exactly the first token, stages
    the prompt's KV (host memory, Ray object store) and frees its own blocks
    -> the first token goes to the client at once, before decode starts
    -> decode replica: fetches and imports the KV, continues from the first token, streams

The ingress pipeline iterates this like a colocated replica's stream, so timeouts, stopInfer and
client disconnects end it at any stage the same way: cancelling the awaited prefill cancels the
prefill replica's coroutine (its engine aborts the request), closing the decode stream aborts it
on the decode replica, and a staged KV object nobody fetches is freed with its last reference.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from serve_app.messages import DecodeRequest, ReplicaChunk, ReplicaRequest
from serve_app.tokenizer.limits import TokenLimits


async def pd_generate(
    backend: Any, model: str, req: ReplicaRequest, limits: TokenLimits
) -> AsyncIterator[ReplicaChunk]:
    start = time.monotonic()
    result = await backend.prefill(model, req)
    first = result.chunk
    yield first
    if first.finished or first.error is not None or result.transfer is None:
        return
    first_token = first.choices[0].token_ids[0]
    if req.timeout_s is not None:  # the request's timeout covers prefill and decode together
        req = dataclasses.replace(
            req, timeout_s=max(0.0, req.timeout_s - (time.monotonic() - start))
        )
    decode = DecodeRequest(
        request=req,
        first_token_id=first_token,
        transfer=result.transfer,
        generator_state=result.generator_state,
        first_text_held=result.first_text_held,
        max_output_tokens=limits.pd_total_tokens(req.params.max_tokens),
        elapsed_s=time.monotonic() - start,  # the e2eTimeout window carries on at decode
    )
    staged_ms = result.transfer.staged_ms
    result = None  # the ingress keeps no reference to the staged KV once decode has it
    stream = backend.decode(model, decode)
    first_decode = True
    try:
        async for chunk in stream:
            if first_decode:
                first_decode, decode.transfer = False, None
                # the hand-off is both sides: staging on prefill, fetch + import on decode
                if chunk.handoff_ms is not None:
                    chunk.handoff_ms += staged_ms
            # To the decode engine its first token is a "first token"; to the client it is a
            # later one: report its time as decode time, as colocated streams do.
            for step in chunk.steps:
                if step.prefill_time_ms is not None:
                    step.decode_time_ms, step.prefill_time_ms = step.prefill_time_ms, None
            yield chunk
    finally:
        await stream.aclose()
