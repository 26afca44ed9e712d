"""`ServerConfig`: the HTTP front end's section (MindIE config.json names)."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from serve_app.engine.config import EngineConfig

_FROZEN = ConfigDict(extra="forbid", frozen=True)
_ENGINE = EngineConfig()  # the engine's defaults are the config's defaults


class ServerConfig(BaseModel):
    model_config = _FROZEN

    ipAddress: str = Field("127.0.0.1", description="Address the business port listens on.")
    port: int = Field(
        8000,
        ge=1,
        le=65535,
        description=(
            "Business (inference) port. Our default is 8000, Ray Serve's HTTP port; "
            "MindIE's is 1025."
        ),
    )
    managementPort: int = Field(1026, ge=1, le=65535, description="Management port.")
    metricsPort: int = Field(1027, ge=1, le=65535, description="Prometheus metrics port.")
    maxLinkNum: int = Field(
        1000,
        ge=1,
        le=4096,
        description=(
            "Requests served at once; twice as many more may queue, the rest are refused."
        ),
    )
    httpsEnabled: bool = Field(
        False,
        description=(
            "TLS on the business port. Default false (MindIE: true): we serve plain HTTP "
            "through Ray Serve; terminate TLS in front of it."
        ),
    )
    fullTextEnabled: bool = Field(False, description="Stream chunks carry the whole text so far.")
    apiKeys: tuple[SecretStr, ...] = Field(
        (),
        description=(
            "(extension) API keys: with any, every route but health and metrics needs "
            "'Authorization: Bearer <key>'; the SERVE_APP_API_KEYS environment variable "
            "(comma-separated) adds to them where the app is built. Empty: no keys asked."
        ),
    )
    inferMode: Literal["standard", "dmi"] = Field(
        "standard",
        description=(
            "standard: prefill and decode on one instance; dmi: prefill/decode separation."
        ),
    )
    interCommPort: int = Field(1121, ge=1, le=65535, description="Port for intra-cluster traffic.")
    openAiSupport: Literal["vllm"] = Field("vllm", description="OpenAI API dialect; only vllm.")
    tokenTimeout: int = Field(
        int(_ENGINE.token_timeout_s),
        ge=1,
        le=3600,
        description=("Longest gap between two tokens of one request, in seconds."),
    )
    e2eTimeout: int = Field(
        int(_ENGINE.e2e_timeout_s),
        ge=1,
        le=65535,
        description="Longest life of a request, seconds.",
    )
    kvConnector: Literal["object_store"] = Field(
        "object_store",
        description=(
            "(extension) inferMode dmi: how KV moves from prefill to decode. object_store: "
            "staged on the host and moved through the Ray object store (works across nodes)."
        ),
    )
    kvLossPolicy: Literal["recompute", "fail"] = Field(
        "recompute",
        description=(
            "(extension) inferMode dmi: when a prefill's KV is lost before decode imports it "
            "(prefill replica died, object lost): recompute the prompt on the decode replica, or "
            "fail the request."
        ),
    )
    maxRequestLength: int = Field(40, ge=1, le=100, description="Largest request body, in MB.")
    tokenStream: Literal["socket", "tcp", "ray"] = Field(
        "socket",
        description=(
            "(extension) How model replicas send streamed chunks to the ingress: socket (from "
            "the ingress's node, a Unix socket per ingress and replica, one write per engine "
            "step for all its requests; from other nodes through Ray), tcp (the same, and from "
            "other nodes over TCP to the ingress's node address) or ray (one Ray Serve message "
            "per chunk)."
        ),
    )

    streamInterval: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "(extension) Tokens per streamed chunk, 1 to 1024: a stream's chunks are held "
            "back until they carry this many new tokens each; its first and last chunks go at "
            "once. 1 sends every token as it comes; larger values cut the serving path's work "
            "per token at the cost of burstier streams (vLLM's --stream-interval). Chat and "
            "completions requests may raise it for themselves with stream_interval."
        ),
    )

    @field_validator("apiKeys")
    @classmethod
    def _keys(cls, keys):
        for key in keys:
            text = key.get_secret_value()
            if not text or any(c.isspace() or c == "," for c in text):
                raise ValueError("every key must be non-empty, without spaces or commas")
        return keys

    @field_validator("ipAddress")
    @classmethod
    def _ip(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an IPv4 or IPv6 address") from None
        return value
