"""Soak: mixed traffic for a long while, then everything back to idle.

    .venv/bin/python -m bench.soak                        # starts the demo server, 10 minutes
    .venv/bin/python -m bench.soak --duration 60          # the CI length
    .venv/bin/python -m bench.soak --url http://127.0.0.1:8000 --model demo   # a running one

--clients concurrent loops each pick, at random, one request of every API family (MindIE
/infer stream and not, OpenAI chat and completions stream and not, Triton generate and
generate_stream, Databricks invocations, embeddings when the server has an endpoint) and one
fate: read to the end, hang up after the first event (a client disconnect), a server-side
`timeout` too short to finish, a client-side timeout, or a stopInfer from a second connection.
Every request must end with an answer or a clear error (no 5xx other than a timeout's, no hang).
Afterwards /metrics must show nothing running or waiting and an empty KV cache, and the resident
memory of the serving processes (Ray's ServeReplica workers and the engine processes, on this
machine) must be within --rss-slack-mb of what it was after the warm-up. The JSON goes under
bench/results/soak/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent

from bench.common import Run, default_out, log, machine_info  # noqa: E402
from bench.overload import replica_rss_mb, scrape, start_server  # noqa: E402
from bench.server_process import stop_server, wait_ready  # noqa: E402

FATES = ("complete", "disconnect", "server_timeout", "client_timeout", "stop")
CLIENT_TIMEOUT_S = 0.3
IDLE_KEYS = ("num_requests_running", "num_requests_waiting", "npu_cache_usage_perc")


@dataclass
class Outcome:
    family: str
    fate: str
    status: int | None = None  # HTTP status (None: no answer: hung up or timed out by us)
    error: str | None = None  # what went wrong from the soak's point of view
    seconds: float = 0.0


@dataclass
class Soak:
    url: str
    model: str
    embedding: str | None
    rng: random.Random
    max_tokens: int
    outcomes: list[Outcome] = field(default_factory=list)
    stop_ids: int = 0

    def families(self) -> list[str]:
        names = ["infer", "infer_stream", "chat", "chat_stream", "completions",
                 "completions_stream", "triton", "triton_stream", "databricks"]  # fmt: skip
        return names + (["embeddings"] if self.embedding else [])

    def request(self, family: str, fate: str) -> tuple[str, dict]:
        """(path, body) of one request of `family`, set up for `fate`."""
        n = self.rng.randint(1, self.max_tokens)
        text = " ".join(
            self.rng.choice(("soak", "test", "load", "token", "hello")) for _ in range(8)
        )
        timeout = {"timeout": 0.05} if fate == "server_timeout" else {}
        if family.startswith("infer"):
            params = {"max_new_tokens": n, **timeout}
            return "/infer", {
                "inputs": text,
                "stream": family.endswith("stream"),
                "parameters": params,
            }
        if family.startswith("chat"):
            body = {"model": self.model, "messages": [{"role": "user", "content": text}],
                    "max_tokens": n, "stream": family.endswith("stream"), **timeout}  # fmt: skip
            return "/v1/chat/completions", body
        if family.startswith("completions"):
            body = {"model": self.model, "prompt": text, "max_tokens": n,
                    "stream": family.endswith("stream"), **timeout}  # fmt: skip
            return "/v1/completions", body
        if family.startswith("triton"):
            self.stop_ids += 1
            path = f"/v2/models/{self.model}/generate" + ("_stream" if "stream" in family else "")
            body = {"id": f"soak-{self.stop_ids}", "text_input": text,
                    "parameters": {"max_new_tokens": n, **timeout}}  # fmt: skip
            return path, body
        if family == "databricks":
            return f"/serving-endpoints/{self.model}/invocations", {
                "messages": [{"role": "user", "content": text}], "max_tokens": n}  # fmt: skip
        return "/v1/embeddings", {"model": self.embedding, "input": [text, text[::-1]]}

    async def one(self, client: httpx.AsyncClient) -> Outcome:
        family = self.rng.choice(self.families())
        fate = self.rng.choice(FATES)
        if fate == "stop" and not family.startswith("triton"):
            fate = "complete"  # stopInfer addresses Triton ids
        if fate == "server_timeout" and family in ("databricks", "embeddings"):
            fate = "complete"  # no per-request timeout field there
        path, body = self.request(family, fate)
        outcome = Outcome(family, fate)
        start = time.monotonic()
        try:
            if fate == "client_timeout":
                try:
                    await asyncio.wait_for(
                        self._exchange(client, path, body, outcome), CLIENT_TIMEOUT_S
                    )
                except asyncio.TimeoutError:
                    outcome.status = None  # we gave up: the server must clean up after us
            elif fate == "stop":
                stopper = asyncio.create_task(self._stop(client, body["id"]))
                await self._exchange(client, path, body, outcome)
                await stopper
            else:
                await self._exchange(client, path, body, outcome, hang_up=fate == "disconnect")
        except httpx.HTTPError as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.seconds = time.monotonic() - start
        self._judge(outcome)
        return outcome

    async def _exchange(self, client, path, body, outcome: Outcome, hang_up: bool = False) -> None:
        async with client.stream("POST", self.url + path, json=body) as response:
            outcome.status = response.status_code
            async for line in response.aiter_lines():
                if hang_up and line.strip():
                    return  # the first event arrived: the client goes away
            if response.status_code >= 500 and outcome.fate != "server_timeout":
                outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"

    async def _stop(self, client: httpx.AsyncClient, request_id: str) -> None:
        for _ in range(20):  # until the request is known, or it has finished
            response = await client.post(
                f"{self.url}/v2/models/{self.model}/stopInfer", json={"id": request_id}
            )
            if response.status_code == 200:
                return
            await asyncio.sleep(0.02)

    @staticmethod
    def _judge(outcome: Outcome) -> None:
        if outcome.error is None and outcome.status is not None and outcome.status >= 500:
            if outcome.fate != "server_timeout":  # MindIE words its timeouts as 500
                outcome.error = f"HTTP {outcome.status}"


async def soak(
    url: str, duration_s: float, clients: int, seed: int, model: str | None = None,
    max_tokens: int = 32,
) -> dict:  # fmt: skip
    """Runs the traffic; returns counts, errors and the server's state after it."""
    async with httpx.AsyncClient(timeout=120) as client:
        models = (await client.get(f"{url}/v1/models")).json()["data"]
        model = model or models[0]["id"]
        endpoints = (await client.get(f"{url}/api/2.0/serving-endpoints")).json()["endpoints"]
        embedding = next((e["name"] for e in endpoints if e["task"] == "llm/v1/embeddings"), None)
        state = Soak(url, model, embedding, random.Random(seed), max_tokens)
        stop_at = time.monotonic() + duration_s

        async def loop() -> None:
            while time.monotonic() < stop_at:
                state.outcomes.append(await state.one(client))

        await asyncio.gather(*(loop() for _ in range(clients)))
    return {
        "requests": len(state.outcomes),
        "by_family": dict(Counter(o.family for o in state.outcomes)),
        "by_fate": dict(Counter(o.fate for o in state.outcomes)),
        "statuses": dict(Counter(str(o.status) for o in state.outcomes)),
        "errors": [f"{o.family}/{o.fate}: {o.error}" for o in state.outcomes if o.error][:20],
        "num_errors": sum(o.error is not None for o in state.outcomes),
        "longest_s": max((o.seconds for o in state.outcomes), default=0.0),
    }


def settle(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """/metrics once nothing runs or waits and the KV cache is empty (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(url)
        idle = {key: metrics.get(key, float("nan")) for key in IDLE_KEYS}
        if all(value == 0 for value in idle.values()) or time.monotonic() > deadline:
            return idle
        time.sleep(0.5)


def rss_growth(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {role: after.get(role, 0.0) - mb for role, mb in before.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server's base URL (default: start one)")
    p.add_argument("--config", type=Path, default=HERE / "demo.yaml")
    p.add_argument("--model")
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of the same traffic first")
    p.add_argument("--rss-slack-mb", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=default_out("soak"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run.begin(machine_info(("torch", "ray")))
    process, url, ok = None, args.url, False
    if url is None:
        log(f"starting the server ({args.config})")
        server_log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
        process, url = start_server(args.config, 1000, server_log)
    try:
        wait_ready(url, 600, process)
        log(f"warm-up: {args.warmup:.0f} s ...")
        asyncio.run(
            soak(url, args.warmup, args.clients, args.seed + 1, args.model, args.max_tokens)
        )
        settle(url)
        rss_before = replica_rss_mb()
        log(f"soak: {args.duration:.0f} s, {args.clients} clients ...")
        result = asyncio.run(
            soak(url, args.duration, args.clients, args.seed, args.model, args.max_tokens)
        )
        idle = settle(url)
        rss_after = replica_rss_mb()
        growth = rss_growth(rss_before, rss_after)
        result.update(
            after=idle, rss_mb={"before": rss_before, "after": rss_after, "growth": growth}
        )
        ok = (
            result["num_errors"] == 0
            and all(value == 0 for value in idle.values())
            and all(mb <= args.rss_slack_mb for mb in growth.values())
        )
        result["ok"] = ok
        print(json.dumps({k: result[k] for k in ("requests", "by_fate", "statuses", "num_errors")}))
        print(f"after: {idle}; RSS growth MB: { {k: round(v) for k, v in growth.items()} }")
        print("OK" if ok else f"NOT OK: {result['errors'][:5]}")
        run.write(args.out, duration_s=args.duration, clients=args.clients, **result)
    finally:
        if process is not None:
            stop_server(process)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
