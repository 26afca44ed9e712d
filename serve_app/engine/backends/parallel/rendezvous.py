"""Where the ranks of one model instance meet (torch.distributed's TCP rendezvous): a module
of its own, without torch, because the model replica names it before anything loads torch (the
app's builder imports the replica's class, and `python -m serve_app` waits for that)."""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0's host and a free port there."""

    host: str
    port: int

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, address: str) -> Rendezvous:
        host, _, port = address.rpartition(":")
        return cls(host, int(port))

    @classmethod
    def here(cls, host: str = "127.0.0.1") -> Rendezvous:
        """A port free on `host` now (the group binds it moments later)."""
        with socket.socket() as s:
            s.bind((host, 0))
            return cls(host, s.getsockname()[1])
