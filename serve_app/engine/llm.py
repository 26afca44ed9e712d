"""Offline batch generation, shaped like vLLM's `LLM` so that users know it.

from serve_app.engine import LLM, SamplingParams
llm = LLM(model="demo", dtype="float32", maxIterTimes=64)
outs = llm.generate([[151644, 872, 198]], SamplingParams(temperature=0, max_tokens=16))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from serve_app.engine.config import EngineConfig
from serve_app.engine.inputs import EngineRequest
from serve_app.engine.outputs import RequestOutput
from serve_app.engine.params import DEFAULT_PRIORITY, SamplingParams


class LLM:
    def __init__(self, model: str = "demo", **overrides):
        from serve_app.engine.llm_engine import LLMEngine  # the model code, on first use

        self.config = EngineConfig.from_overrides(model, **overrides)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the ranks a `world_size` above 1 started (they also end with this process)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (token ids, or text to tokenize); results in input order."""
        prompt_ids = [
            self.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
            for p in prompts
        ]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompt_ids)
        if len(params) != len(prompt_ids):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompt_ids)} prompts")
        priorities = priorities or [DEFAULT_PRIORITY] * len(prompt_ids)
        order = []
        for ids, p, priority in zip(prompt_ids, params, priorities, strict=True):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(EngineRequest(request_id, ids, p, priority=priority))
            order.append(request_id)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(order):
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        results = [finished[request_id] for request_id in order]
        for result in results:
            for completion in result.outputs:
                completion.new_token_ids = completion.token_ids
                completion.text = self.tokenizer.decode(
                    completion.token_ids, skip_special_tokens=True
                )
        return results
