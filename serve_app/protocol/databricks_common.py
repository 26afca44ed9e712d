"""What the Databricks Foundation Model API requests share: their sampling ranges, the fields
its clients send that change nothing here, the endpoint objects of /api/2.0/serving-endpoints
(docs/apis.md#databricks-foundation-model-apis).

The Databricks ranges differ from the MindIE-flavoured OpenAI routes: temperature [0, 2] with 0
meaning greedy, top_k null or > 0, max_tokens null meaning "up to the model's limit".
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from serve_app.protocol.errors import invalid
from serve_app.protocol.fields import INT32_MAX, Range, RequestModel
from serve_app.protocol.openai_common import StreamOptions, StreamUsage

Temperature = Annotated[float | None, Range(0.0, 2.0)]
TopP = Annotated[float | None, Range(0.0, 1.0, low_open=True)]
PositiveInt = Annotated[int | None, Range(0, INT32_MAX, low_open=True)]
NumChoices = Annotated[int | None, Range(1, 128)]
TopLogprobs = Annotated[int | None, Range(0, 20)]

# Sent by the databricks-sdk and the Databricks docs' clients; recorded by Databricks for its
# inference tables, nothing to do here.
IGNORED_FIELDS = ("client_request_id", "usage_context", "extra_params", "user")

# Databricks' task names, as /api/2.0/serving-endpoints reports them.
CHAT_TASK = "llm/v1/chat"
COMPLETIONS_TASK = "llm/v1/completions"
EMBEDDINGS_TASK = "llm/v1/embeddings"


class DatabricksSampling(StreamUsage, RequestModel):
    """The sampling fields chat and completions share, with Databricks' documented ranges and
    defaults."""

    model: str | None = Field(
        None, description="The endpoint name on the OpenAI-compatible paths; ignored on "
        "/serving-endpoints/{name}/invocations, where the path names it.",
    )  # fmt: skip
    max_tokens: PositiveInt = Field(
        None, description="null (up to the model's limit) or > 0; at most maxIterTimes."
    )
    stream: bool | None = Field(False, description="Server-sent events, ending in [DONE].")
    stream_options: StreamOptions | None = None
    temperature: Temperature = Field(None, description="[0.0, 2.0], default 1.0; 0 is greedy.")
    top_p: TopP = Field(None, description="(0.0, 1.0], default 1.0.")
    top_k: PositiveInt = Field(None, description="null (off) or > 0; 1 is deterministic.")
    n: NumChoices = Field(None, description="[1, 128] independent choices, default 1.")
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None, description="Only reasoning models take it; refused for the models served here."
    )

    def check_common(self) -> None:
        self.check_stream_options()
        if self.reasoning_effort is not None:
            raise invalid(
                "reasoning_effort",
                "is only accepted by reasoning models; the models served here do not reason",
            )


def endpoint(name: str, task: str, created: int, ready: bool) -> dict:
    """One endpoint as /api/2.0/serving-endpoints lists it (the databricks-sdk's
    `ServingEndpoint`): the name, its task and its state."""
    return {
        "name": name,
        "id": name,
        "task": task,
        "creator": "serve_app",
        "creation_timestamp": created * 1000,
        "last_updated_timestamp": created * 1000,
        "state": {"ready": "READY" if ready else "NOT_READY", "config_update": "NOT_UPDATING"},
        "config": {"served_entities": [{"name": name, "entity_name": name}]},
    }
