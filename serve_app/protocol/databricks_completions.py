"""Databricks completions (task llm/v1/completions): one prompt or a batch of them, each run as
its own engine request; the choices of prompt i are numbered i * n + j (docs/apis.md#databricks-
completions).

- `use_raw_prompt` false (the default) sends each prompt through the model's chat template as one
  user turn, as Databricks' hosted models do (usage counts the template's tokens); true sends it
  as is. A model without a chat template always gets it as is.
- `echo` puts the prompt as sent (not the template) before each choice's text; `suffix` goes
  after it.
- `error_behavior` "truncate": a prompt over its token limit keeps its last tokens instead of
  being refused, and a request that times out returns what it generated with finish_reason
  "length"; "error" (the default) answers 400 / 504 for those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from serve_app.messages import (
    ChoiceDelta,
    ReplicaChunk,
    ReplicaRequest,
    TokenizedPrompt,
    TokenizeRequest,
)
from serve_app.protocol.databricks_common import DatabricksSampling
from serve_app.protocol.defaults import ServerDefaults
from serve_app.protocol.fields import Stop, StringOrStrings
from serve_app.protocol.openai_common import usage
from serve_app.protocol.openai_completions import MAX_PROMPT_CHARS
from serve_app.protocol.pd_refusals import refuse_in_pd
from serve_app.protocol.sampling import openai_finish, sampled_request

MAX_PROMPTS = 128  # prompts in one batch request
_PROMPT_RULE = (
    f"must be a non-empty string of at most {MAX_PROMPT_CHARS} characters or a list of 1 to "
    f"{MAX_PROMPTS} such strings"
)


Prompts = StringOrStrings(MAX_PROMPTS, _PROMPT_RULE, MAX_PROMPT_CHARS)


class DatabricksCompletionRequest(DatabricksSampling):
    prompt: Prompts = Field(description="A string or a list of strings (a batch).")
    stop: Stop = Field(None, description="A string or a list of strings that end a completion.")
    suffix: str = Field("", description="Appended to every completion.")
    echo: bool = Field(False, description="The prompt before each completion.")
    use_raw_prompt: bool = Field(False, description="true: no chat template around the prompt.")
    error_behavior: Literal["truncate", "error"] = Field(
        "error", description="On a context overflow or a timeout: return what fits, or an error."
    )

    def check(self, pd_mode: bool) -> None:
        refuse_in_pd(pd_mode, {"stop": bool(self.stop), "n": (self.n or 1) > 1})
        self.check_common()

    @property
    def truncate(self) -> bool:
        return self.error_behavior == "truncate"

    def per_prompt(self) -> list[OnePrompt]:
        """The batch as one translatable request per prompt (the batch was checked once)."""
        return [OnePrompt(self, i) for i in range(len(self.prompt))]


@dataclass(slots=True)
class OnePrompt:
    """Prompt `index` of a completion request, as the pipeline translates it."""

    body: DatabricksCompletionRequest
    index: int

    def check(self, pd_mode: bool) -> None:
        """Nothing: the whole request was checked before it was split."""

    def tokenize_request(self, model: str) -> TokenizeRequest:
        text, param = self.body.prompt[self.index], _param(self.body, self.index)
        kind = "completion" if self.body.use_raw_prompt else "templated"
        return TokenizeRequest(
            model=model, kind=kind, text=text, param=param, truncate=self.body.truncate
        )

    def replica_request(
        self, request_id: str, prompt: TokenizedPrompt, defaults: ServerDefaults
    ) -> ReplicaRequest:
        b = self.body
        return sampled_request(
            request_id, prompt, defaults,
            temperature=b.temperature, top_p=b.top_p, top_k=b.top_k,
            max_tokens=b.max_tokens, n=b.n, stream=b.stream, stop=b.stop,
        )  # fmt: skip


def _param(body: DatabricksCompletionRequest, index: int) -> str:
    return "prompt" if len(body.prompt) == 1 else f"prompt[{index}]"


# -- responses --------------------------------------------------------------------------------


class CompletionRenderer:
    """Replica chunks of every prompt -> choices numbered prompt * n + choice, with echo and
    suffix applied; both the non-stream body and the stream events come from here."""

    def __init__(
        self, body: DatabricksCompletionRequest, request_id: str, created: int, model: str
    ) -> None:
        self.body = body
        self.n = body.n or 1
        self.head = {"id": request_id, "object": "text_completion", "created": created}
        self.model = model
        self.started: set[int] = set()
        self.finished: set[int] = set()
        self.num_tokens: dict[int, int] = {}
        self.num_prompt: dict[int, int] = {}

    def _text(self, prompt: int, index: int, delta: ChoiceDelta) -> str:
        text = delta.text
        if index not in self.started:
            self.started.add(index)
            if self.body.echo:
                text = self.body.prompt[prompt] + text
        if delta.finish_reason is not None:
            self.finished.add(index)
            text += self.body.suffix
        return text

    def _choices(self, prompt: int, chunk: ReplicaChunk, timed_out: bool) -> list[dict]:
        self.num_prompt[prompt] = chunk.num_prompt_tokens or self.num_prompt.get(prompt, 0)
        out = []
        for delta in chunk.choices:
            index = prompt * self.n + delta.index
            self.num_tokens[index] = max(self.num_tokens.get(index, 0), delta.num_output_tokens)
            if timed_out and delta.finish_reason is None:
                delta = ChoiceDelta(delta.index, [], delta.text, finish_reason="length")
            reason = delta.finish_reason
            text = self._text(prompt, index, delta)
            if not text and reason is None:
                continue
            out.append({"index": index, "text": text, "logprobs": None,
                        "finish_reason": openai_finish(reason)})  # fmt: skip
        return out

    def usage(self) -> dict:
        return usage(sum(self.num_prompt.values()), sum(self.num_tokens.values()))

    def response(self, chunks: list[ReplicaChunk]) -> dict:
        """The non-stream body from each prompt's folded chunk (one that did not finish timed
        out under error_behavior "truncate": its choices end with "length")."""
        choices = []
        for prompt, chunk in enumerate(chunks):
            choices.extend(self._choices(prompt, chunk, timed_out=not chunk.finished))
        choices.sort(key=lambda c: c["index"])
        return {**self.head, "model": self.model, "choices": choices, "usage": self.usage()}

    def events(self, prompt: int, chunk: ReplicaChunk, timed_out: bool = False) -> list[dict]:
        """The stream events of one prompt's chunk (one per choice with something new)."""
        return [
            {**self.head, "model": self.model, "choices": [choice]}
            for choice in self._choices(prompt, chunk, timed_out)
        ]

    def timeout_events(self, prompt: int) -> list[dict]:
        """A prompt that timed out under error_behavior "truncate": its unfinished choices end
        with "length" after what they generated."""
        first = prompt * self.n
        unfinished = [
            ChoiceDelta(j, [], "") for j in range(self.n) if first + j not in self.finished
        ]
        return self.events(prompt, ReplicaChunk(request_id="", choices=unfinished), True)

    def usage_event(self) -> dict:
        return {**self.head, "model": self.model, "choices": [], "usage": self.usage()}
