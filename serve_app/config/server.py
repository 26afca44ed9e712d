"""`ServerConfig`: the HTTP front end's section (MindIE config.json names)."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from serve_app.config.effects import Section, acts, no_effect, refused
from serve_app.engine.config import EngineConfig

_ENGINE = EngineConfig()  # the engine's defaults are the config's defaults


class ServerConfig(Section):
    ipAddress: str = Field(
        "127.0.0.1",
        description="Address the business port listens on.",
        json_schema_extra=no_effect(
            "the server listens on the address in the Serve config file's http_options.host"
        ),
    )
    port: int = Field(
        8000,
        ge=1,
        le=65535,
        description="Business (inference) port; MindIE's default is 1025.",
        json_schema_extra=no_effect(
            "the server listens on the port in the Serve config file's http_options.port"
        ),
    )
    managementPort: int = Field(
        1026,
        ge=1,
        le=65535,
        description="Management port.",
        json_schema_extra=no_effect(
            "management routes are served on the business port (http_options.port)"
        ),
    )
    metricsPort: int = Field(
        1027,
        ge=1,
        le=65535,
        description="Prometheus metrics port.",
        json_schema_extra=no_effect("/metrics is served on the business port (http_options.port)"),
    )
    maxLinkNum: int = Field(
        1000,
        ge=1,
        le=4096,
        description=(
            "Requests served at once; twice as many more may queue, the rest are refused."
        ),
        json_schema_extra=acts(),
    )
    httpsEnabled: bool = Field(
        False,
        description="TLS on the business port (MindIE's default: true).",
        json_schema_extra=refused(
            "the server speaks plain HTTP through Ray Serve; terminate TLS in front of it (a "
            "reverse proxy or load balancer) and set httpsEnabled: false",
            when=("==", True),
        ),
    )
    fullTextEnabled: bool = Field(
        False, description="Stream chunks carry the whole text so far.", json_schema_extra=acts()
    )
    apiKeys: tuple[SecretStr, ...] = Field(
        (),
        description=(
            "(extension) API keys: with any, every route but health and metrics needs "
            "'Authorization: Bearer <key>'; the SERVE_APP_API_KEYS environment variable "
            "(comma-separated) adds to them where the app is built. Empty: no keys asked."
        ),
        json_schema_extra=acts(),
    )
    inferMode: Literal["standard", "dmi"] = Field(
        "standard",
        description=(
            "standard: prefill and decode on one instance; dmi: prefill/decode separation."
        ),
        json_schema_extra=acts(),
    )
    interCommPort: int = Field(
        1121,
        ge=1,
        le=65535,
        description="Port for intra-cluster traffic.",
        json_schema_extra=no_effect(
            "deployments talk through Ray, and streamed tokens reach the ingress through the "
            "token socket (ServerConfig.tokenStream), whose TCP port is picked at start"
        ),
    )
    openAiSupport: Literal["vllm"] = Field(
        "vllm",
        description="OpenAI API dialect.",
        json_schema_extra=no_effect(
            "the OpenAI routes always speak vLLM's dialect; leave the key out"
        ),
    )
    tokenTimeout: int = Field(
        int(_ENGINE.token_timeout_s),
        ge=1,
        le=3600,
        description="Longest gap between two tokens of one request, in seconds.",
        json_schema_extra=acts(),
    )
    e2eTimeout: int = Field(
        int(_ENGINE.e2e_timeout_s),
        ge=1,
        le=65535,
        description="Longest life of a request, seconds.",
        json_schema_extra=acts(),
    )
    kvConnector: Literal["object_store"] = Field(
        "object_store",
        description=(
            "(extension) inferMode dmi: how KV moves from prefill to decode. object_store: "
            "staged on the host and moved through the Ray object store (works across nodes)."
        ),
        json_schema_extra=acts(),
    )
    kvLossPolicy: Literal["recompute", "fail"] = Field(
        "recompute",
        description=(
            "(extension) inferMode dmi: when a prefill's KV is lost before decode imports it "
            "(prefill replica died, object lost): recompute the prompt on the decode replica, or "
            "fail the request."
        ),
        json_schema_extra=acts(),
    )
    maxRequestLength: int = Field(
        40, ge=1, le=100, description="Largest request body, in MB.", json_schema_extra=acts()
    )
    tokenStream: Literal["socket", "tcp", "ray"] = Field(
        "socket",
        description=(
            "(extension) How model replicas send streamed chunks to the ingress: socket (from "
            "the ingress's node, a Unix socket per ingress and replica, one write per engine "
            "step for all its requests; from other nodes through Ray), tcp (the same, and from "
            "other nodes over TCP to the ingress's node address) or ray (one Ray Serve message "
            "per chunk)."
        ),
        json_schema_extra=acts(),
    )
    streamKeepAlive: float = Field(
        5.0,
        ge=0,
        le=300,
        description=(
            "(extension) Seconds a stream waits for its first token before it is answered 200 "
            "and sent an SSE comment (': keep-alive') every as many seconds until the token "
            "comes, so that proxies and load balancers that cut idle connections keep queued "
            "streams; an error after that is the stream's last event. 0: a stream is answered "
            "only once its first token or its error exists."
        ),
        json_schema_extra=acts(),
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
        json_schema_extra=acts(),
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
