"""ModelReplica: one engine on one accelerator, streaming `ReplicaChunk`s for `ReplicaRequest`s.

A plain class: the app builder turns it into a Ray Serve deployment, and Ray Serve calls
`generate` with `handle.options(stream=True).generate.remote(req)`. Errors (a refused request, a
failed step, a timeout) end the stream with a final chunk that carries them; `generate` never
raises for them, so every API family can render them in its own envelope.

In PD mode (inferMode dmi) a replica has a role: "prefill" replicas answer `prefill` (the first
token and a handle to the prompt's KV, staged through a `serve_app.disagg` connector), "decode"
replicas answer `decode` (fetch and import that KV, then stream like `generate`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from serve_app.config import AppConfig, accelerator_env
from serve_app.disagg.connector import KVConnector, connector_for
from serve_app.disagg.handoff import KV_LOSS_POLICIES, Handoff, HandoffFailed, fetch_kv
from serve_app.engine.host.async_engine import AsyncEngine
from serve_app.engine.inputs import EngineRequest
from serve_app.engine.kv_transfer import ImportedPrefill
from serve_app.messages import DecodeRequest, ErrorKind, PrefillResult, ReplicaChunk, ReplicaRequest
from serve_app.placement import AUTO, bind_process
from serve_app.replica.identity import replica_id
from serve_app.replica.output_processor import OutputProcessor
from serve_app.replica.ranks import start_engine
from serve_app.replica.relay import RayStream, Relay, Sink
from serve_app.replica.replica_metrics import ReplicaMetrics
from serve_app.replica_cpus import sizing_note
from serve_app.routing.prefix_index import ROUTING_STATS_KEY, RecentBlocks
from serve_app.token_socket.outbox import TokenOutbox, ray_node_id
from serve_app.tokenizer.limits import TokenLimits

logger = logging.getLogger(__name__)

ROLES = ("colocated", "prefill", "decode")


class ModelReplica:
    """role: "colocated" (`generate`), "prefill" (`prefill`: the first token and the
    prompt's KV) or "decode" (`decode`: continue after a prefill). Every role keeps `generate`.
    connector: how prefill stages the KV for decode (`serve_app.disagg.connector`). kv_loss_policy:
    what decode does when the KV cannot be fetched ("recompute" the prompt locally, or "fail").
    off_engine_cores: when the engine process is bound to cores (engineCpus), bind this process,
    whose work is the serving path's, to the cores no engine is bound to (the app builder asks).
    """

    def __init__(
        self,
        config: AppConfig | None = None,
        model_index: int = 0,
        role: str = "colocated",
        connector: str | None = None,
        kv_loss_policy: str | None = None,
        off_engine_cores: bool = False,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        app_config = config or AppConfig()  # validated once, by the builder
        server = app_config.ServerConfig  # kvConnector / kvLossPolicy unless given here
        connector = connector or server.kvConnector
        kv_loss_policy = kv_loss_policy or server.kvLossPolicy
        if kv_loss_policy not in KV_LOSS_POLICIES:
            raise ValueError(f"kv_loss_policy must be one of {KV_LOSS_POLICIES}")
        self.role = role
        self.connector: KVConnector = connector_for(connector)
        self.kv_loss_policy = kv_loss_policy
        self.num_kv_lost = 0  # decode: hand-offs whose KV could not be fetched
        engine_config = app_config.engine_config(model_index, role)
        self.limits = TokenLimits.of(app_config)
        self.model_name = engine_config.model_name
        self.replica_id = replica_id()
        self.engine: AsyncEngine | None = None  # set last: __del__ may see a failed __init__
        self.outbox = TokenOutbox(ray_node_id())  # links to ingress token sockets on this node
        self.recent = RecentBlocks(engine_config.block_size)  # for the prefix-aware routers
        # print, not log: Ray forwards replica stdout to `serve run`, so users see the progress
        loading = f"model replica {self.replica_id} ({role}): loading {engine_config.model!r} ..."
        print(loading, flush=True)
        start = time.monotonic()
        self.engine, self.ranks = start_engine(engine_config)  # worldSize > 1: ranks as actors
        if off_engine_cores and engine_config.engine_cpus:  # loaded on every core, served on these
            bind_process(app_config.serving_cores())
        self.metrics = ReplicaMetrics(self.model_name, role, self.engine.stats)  # per replica
        self.tokenizer = self.engine.tokenizer
        info = self.engine.info
        where = "its own process" if engine_config.engine_process else "a thread"
        model = app_config.BackendConfig.ModelDeployConfig.ModelConfig[model_index]
        where += sizing_note(AUTO in (model.engineCpus, model.engineSpareCpus))
        print(
            f"model replica {self.replica_id}: {self.model_name!r} ready on {info.device} "
            f"({info.dtype}, {info.num_blocks} KV blocks, {info.num_threads} torch threads, "
            f"step loop in {where}{info.placement()}) in {time.monotonic() - start:.1f} s",
            flush=True,
        )

    async def generate(self, req: ReplicaRequest) -> AsyncIterator[ReplicaChunk]:
        """Chunks as the engine produces them (one final chunk when not streaming).

        The last chunk has `finished`, the prompt token count, the engine stats and, if the
        request failed, `error` and `error_kind`. Closing this generator early (client gone)
        aborts the engine request and frees its KV blocks.
        """
        self.recent.add(req.prompt_token_ids)
        request = EngineRequest(
            req.request_id, list(req.prompt_token_ids), req.params, req.priority, _deadline(req)
        )
        async for chunk in self._stream(request, OutputProcessor(req, self.tokenizer)):
            yield chunk

    async def prefill(self, req: ReplicaRequest) -> PrefillResult:
        """PD prefill: run the prompt, sample exactly the first token, stage the prompt's KV.

        The result's chunk carries the first token; it is final (`finished`, stats, error)
        only when the request ends there: an error, EOS, a stop token, an output limit of 1,
        maxSeqLen. Otherwise `transfer` is the KV's handle for a decode replica, and this
        replica's blocks are already free. Cancelling this coroutine (client gone) aborts the
        engine request and frees its blocks.
        """
        self.recent.add(req.prompt_token_ids)
        request = EngineRequest(
            req.request_id, list(req.prompt_token_ids), req.params, req.priority, _deadline(req),
            export_kv=True,
        )  # fmt: skip
        processor = OutputProcessor(req, self.tokenizer)
        output, error = None, None
        try:
            async with aclosing(self.engine.generate(request)) as outputs:
                async for output in outputs:
                    self.metrics.note(output)
                    if output.finished:
                        break
        except Exception as exc:
            error = processor.failure_chunk(exc)
        if error is None and (output is None or not output.finished):
            error = processor.error_chunk(
                ErrorKind.ENGINE, "the engine ended the prefill without output"
            )
        if error is not None:
            return PrefillResult(self._final(error))
        prompt_len = len(req.prompt_token_ids)
        ends = (
            output.kv_payload is None  # EOS / stop token / abort / timeout: nothing to continue
            or self.limits.pd_total_tokens(req.params.max_tokens) <= 1
            or prompt_len + 1 >= self.engine.info.max_model_len
        )
        chunk, held = processor.process_first(output, ends)
        if chunk.finished:
            return PrefillResult(self._final(chunk))
        try:
            transfer = await self.connector.send(output.kv_payload)
        except Exception as exc:
            logger.exception("staging the KV of %s failed", req.request_id)
            message = f"staging the KV for decode failed ({type(exc).__name__}); see the log"
            return PrefillResult(self._final(processor.error_chunk(ErrorKind.ENGINE, message)))
        chunk.kv_bytes = transfer.nbytes
        chunk.replica_id = self.replica_id
        return PrefillResult(chunk, transfer, output.generator_state, first_text_held=held)

    async def decode(self, req: DecodeRequest) -> AsyncIterator[ReplicaChunk]:
        """PD decode: fetch the prompt's KV, import it, and stream the tokens after the first.

        Chunks are those of `generate` for the same request, except that the first token (sent
        by the prefill replica) is not repeated: text continues where the prefill's left off,
        and num_output_tokens counts the first token too. The first chunk carries handoff_ms
        (fetch + import), kv_bytes and kv_recomputed. A KV that cannot be fetched (prefill
        replica gone, object lost) is recomputed from the prompt, or fails the request under
        kv_loss_policy "fail"; the request's timeout running out in the fetch fails it
        (`disagg/handoff.py`). Closing this generator early aborts the request and frees its
        blocks, at any stage.
        """
        r = req.request
        processor = OutputProcessor(r, self.tokenizer, first_token_id=req.first_token_id)
        deadline = _deadline(r)  # the request's timeout covers the hand-off too
        e2e_start = time.monotonic() - req.elapsed_s  # on this replica's clock
        connector = None if req.transfer is None else self._connector_of(req.transfer.connector)
        try:
            kv, handoff = await fetch_kv(
                connector, req.transfer, deadline, r.timeout_s, self.kv_loss_policy, r.request_id
            )
        except HandoffFailed as failed:
            self.num_kv_lost += failed.lost
            yield self._final(processor.error_chunk(failed.kind, failed.message))
            return
        self.num_kv_lost += handoff.lost
        cap = req.max_output_tokens or self.limits.pd_total_tokens(r.params.max_tokens)
        imported = ImportedPrefill(req.first_token_id, kv, req.generator_state, cap)
        request = EngineRequest(
            r.request_id, list(r.prompt_token_ids), r.params, r.priority, deadline,
            imported=imported, e2e_start=e2e_start,
        )  # fmt: skip
        # The engine keeps the payload only until it is written into the pool; nothing here
        # should keep the host copy (or the object-store reference) alive for the whole decode.
        kv, req.transfer = None, None
        async for chunk in self._stream(request, processor, handoff):
            yield chunk

    async def _stream(
        self,
        request: EngineRequest,
        processor: OutputProcessor,
        handoff: Handoff | None = None,
    ) -> AsyncIterator[ReplicaChunk]:
        # The ingress's token socket, if this replica can reach it (see TokenOutbox), else the
        # request's Ray stream: each chunk made and put there as the engine hands its output
        # over (see Relay)
        sink: Sink = await self.outbox.link(processor.req.reply_to) or RayStream()
        relay = Relay(processor, sink, handoff, self.metrics.note)
        try:
            # leaving the block early (every choice hit a stop string, the consumer went away)
            # aborts the engine request now
            with self.engine.feeding(request, relay.take):
                async for chunk in sink.yielded(relay.final):
                    yield chunk
                final = await relay.final
        except Exception as exc:
            final = processor.failure_chunk(exc)
        if handoff is not None:
            handoff.stamp(final)
        if not sink.alive:  # the socket closed: what is left goes through Ray
            sink = RayStream()
        if final.error is not None and (held := processor.hold.take()) is not None:
            sink.put(held, now=True)  # tokens made before the failure, not folded into it
        sink.put(self._final(final), now=True)  # sent before this Ray stream ends
        await sink.drain()
        async for chunk in sink.yielded(None):
            yield chunk

    def _final(self, chunk: ReplicaChunk) -> ReplicaChunk:
        chunk.stats = {**self.engine.stats(), "replica_id": self.replica_id}  # (ingress/metrics)
        chunk.replica_id = self.replica_id
        return chunk

    def _connector_of(self, name: str) -> KVConnector:
        return self.connector if name == self.connector.name else connector_for(name)

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def stats(self) -> dict:
        return {
            **self.engine.stats(),
            "replica_id": self.replica_id,
            "model": self.model_name,
            "role": self.role,
            "num_kv_lost": self.num_kv_lost,
        }

    def record_routing_stats(self) -> dict:
        return {ROUTING_STATS_KEY: self.recent.snapshot()}  # (Ray Serve asks; routing/)

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop died, a rank of whose model
        ended or hangs (its requests end now), or whose step hangs (tokenTimeout) is replaced."""
        engine, ranks, me = self.engine, self.ranks, f"replica {self.replica_id}"
        if engine is not None and engine.is_running and ranks is not None:
            if failure := ranks.failure() or await ranks.unanswered():
                engine.fail(f"{me}: {failure}")
        if engine is None or not engine.is_running:
            raise RuntimeError(engine and engine.failure or f"{me}: the engine loop is not running")
        stalled, limit = engine.stalled_s(), engine.config.token_timeout_s
        if stalled > limit:
            raise RuntimeError(
                f"{me}: the engine has handed over no output for {stalled:.0f} s with requests "
                f"waiting (tokenTimeout {limit:g} s): a step hangs"
            )

    async def device_info(self) -> dict:
        return {
            "replica_id": self.replica_id,
            "model": self.model_name,
            "device": self.engine.info.device,
            "node_id": self.outbox.node_id,
            **accelerator_env(),
        }

    def shutdown(self) -> None:
        for part in (getattr(self, "outbox", None), getattr(self, "metrics", None)):
            if part is not None:
                part.close()
        engine, self.engine = getattr(self, "engine", None), None
        ranks, self.ranks = getattr(self, "ranks", None), None
        stops = [engine and engine.shutdown, ranks and ranks.close]
        if engine is not None and engine.failure:  # a rank hangs: rank 0's step waits for it,
            stops.reverse()  # and fails once the ranks are gone
        for stop in filter(None, stops):
            stop()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter teardown: nothing left to report to
            self.shutdown()


def _deadline(req: ReplicaRequest) -> float | None:
    """The deadline starts when the request reaches the replica, on this replica's clock."""
    return None if req.timeout_s is None else time.monotonic() + req.timeout_s
