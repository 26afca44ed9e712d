"""/tokenize and /detokenize as vLLM serves them: a prompt (or chat messages, through the chat
template) to token ids without generating, and token ids back to text. No length rule applies
(a client counts a prompt's tokens before sending it); errors are OpenAI error objects."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from serve_app.messages import TokenizedPrompt, TokenizeRequest
from serve_app.protocol.fields import RequestModel
from serve_app.protocol.openai_common import ModelName


class TokenizeCompletion(RequestModel):
    model: ModelName | None = Field(None, description="A served model; absent: the first.")
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def tokenize_request(self, model: str) -> TokenizeRequest:
        return TokenizeRequest(
            model, "completion", text=self.prompt, add_special_tokens=self.add_special_tokens,
            counting=True,
        )  # fmt: skip


class TokenizeChat(RequestModel):
    model: ModelName | None = Field(None, description="A served model; absent: the first.")
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False

    def tokenize_request(self, model: str) -> TokenizeRequest:
        return TokenizeRequest(
            model, "chat", messages=self.messages, tools=self.tools, param="messages",
            add_special_tokens=self.add_special_tokens,
            add_generation_prompt=self.add_generation_prompt, counting=True,
        )  # fmt: skip


class Detokenize(RequestModel):
    model: ModelName | None = Field(None, description="A served model; absent: the first.")
    tokens: list[int]

    def tokenize_request(self, model: str) -> TokenizeRequest:
        return TokenizeRequest(
            model, "token_ids", token_ids=self.tokens, param="tokens", counting=True
        )


def tokenize_response(
    body: TokenizeCompletion | TokenizeChat, prompt: TokenizedPrompt, max_model_len: int
) -> dict:
    return {
        "count": prompt.num_prompt_tokens,
        "max_model_len": max_model_len,
        "tokens": prompt.prompt_token_ids,
        "token_strs": prompt.token_strs if body.return_token_strs else None,
    }
