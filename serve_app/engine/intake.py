"""Intake: an `EngineRequest` becomes the engine's `Request`, or is refused before any state.

Refusals are `RequestRejected`, for input the engine can never serve: an unknown token, a
prompt or output that cannot fit the model or the KV pool, a PD hand-off it cannot continue.
Anything accepted here runs to an output; nothing refused leaves a trace.
"""

from __future__ import annotations

from collections.abc import Container

import torch

from serve_app.engine import kv_transfer
from serve_app.engine.config import EngineConfig
from serve_app.engine.errors import RequestRejected
from serve_app.engine.inputs import EngineRequest
from serve_app.engine.kv_cache import KVCacheManager
from serve_app.engine.params import HIGHEST_PRIORITY, LOWEST_PRIORITY, output_cap
from serve_app.engine.sequence import Request, Sequence, seeded_generator


class Intake:
    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int,
        max_model_len: int,
        kv: KVCacheManager,
        kv_layout: tuple[int, int, int],
        device: torch.device,
    ):
        self.config = config
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv = kv
        self.kv_layout = kv_layout  # (layers, KV heads, head size): an imported KV's
        self.device = device

    def __call__(self, request: EngineRequest, ids_in_use: Container[str]) -> Request:
        """The request as the engine tracks it, one sequence ready to schedule."""
        params, imported = request.params, request.imported
        prompt = self._check(request, ids_in_use)
        max_output_tokens = self._max_output_tokens(request)
        self._check_fits(len(prompt), max_output_tokens, params.num_seqs)
        # A PD decode starts as prompt + [first token]: the catch-up rule runs the first token
        # next and samples the second, and the first token is never reported again.
        first = [] if imported is None else [imported.first_token_id]
        seq = Sequence(
            prompt + first, len(prompt), self._generator(request), num_emitted=len(first)
        )
        tracked = Request(
            request.request_id,
            prompt,
            params,
            max_output_tokens,
            priority=request.priority,
            deadline=request.deadline,
            e2e_start=request.e2e_start,
            export_kv=request.export_kv,
        )
        if request.export_kv:  # a grammar plans for the whole output, not the one token
            tracked.planned_output_tokens = output_cap(
                self.config.max_iter_times, params.max_tokens
            )
        tracked.arrival_time = request.arrival_time or tracked.arrival_time
        if imported is not None:  # timing of later tokens counts from the hand-off
            tracked.last_token_time = tracked.arrival_time
        tracked.seqs.append(seq)
        return tracked

    def _max_output_tokens(self, request: EngineRequest) -> int:
        """A PD prefill makes one token. A PD decode may bring its own cap, which counts the
        first token and is not clamped by maxIterTimes (the PD rule can make it maxIterTimes +
        1). Otherwise min(maxIterTimes, max_tokens)."""
        if request.export_kv:
            return 1
        if request.imported is not None and request.imported.max_output_tokens > 0:
            return request.imported.max_output_tokens
        return output_cap(self.config.max_iter_times, request.params.max_tokens)

    def _generator(self, request: EngineRequest) -> torch.Generator | None:
        """The request's own generator, when seeded: as a PD prefill's first token left it when
        handed over, else fresh from the seed (seeded, but then not as colocated)."""
        state = request.imported.generator_state if request.imported is not None else None
        if state is None:
            return seeded_generator(request.params.seed, 0, self.device)
        generator = torch.Generator(device=self.device)
        generator.set_state(state)
        return generator

    def _check(self, request: EngineRequest, ids_in_use: Container[str]) -> list[int]:
        prompt = list(request.prompt_token_ids)
        if request.request_id in ids_in_use:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        if not prompt:
            raise RequestRejected("the prompt is empty")
        if not HIGHEST_PRIORITY <= request.priority <= LOWEST_PRIORITY:
            raise RequestRejected(
                f"priority must be in [{HIGHEST_PRIORITY}, {LOWEST_PRIORITY}], "
                f"got {request.priority}"
            )
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt) > self.max_model_len - 1:
            raise RequestRejected(
                f"the prompt has {len(prompt)} tokens; at most {self.max_model_len - 1} fit"
                f" (maxSeqLen {self.config.max_seq_len})"
            )
        if request.export_kv or request.imported is not None:
            self._check_handoff(request, len(prompt))
        return prompt

    def _check_handoff(self, request: EngineRequest, prompt_len: int) -> None:
        """A PD prefill or decode runs one sequence; a decode's first token and KV must fit."""
        params, imported = request.params, request.imported
        if params.num_seqs != 1 or params.use_beam_search:
            raise RequestRejected("prefill/decode hand-off supports one sequence (n = best_of = 1)")
        if imported is None:
            return
        if request.export_kv:
            raise RequestRejected("a request either exports its prompt's KV or imports it")
        if not 0 <= imported.first_token_id < self.vocab_size:
            raise RequestRejected(
                f"first token id {imported.first_token_id} is outside the vocabulary"
            )
        if imported.kv is not None:
            try:
                kv_transfer.check_layout(self.kv_layout, imported.kv, prompt_len)
            except ValueError as exc:
                raise RequestRejected(str(exc)) from None

    def _check_fits(self, prompt_len: int, max_output_tokens: int, num_seqs: int) -> None:
        """Refuse up front what could never fit the pool, even alone: it would wait forever."""
        total = min(prompt_len + max_output_tokens, self.max_model_len)
        need = self.kv.worst_case_blocks(prompt_len, total, num_seqs)
        if need > self.kv.pool.num_blocks:
            raise RequestRejected(
                f"the request needs up to {need} KV blocks; the pool has {self.kv.pool.num_blocks}"
            )
