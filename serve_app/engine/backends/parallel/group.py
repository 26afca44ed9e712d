"""The ranks of one model instance as a torch.distributed group.

Collectives run on the device's own backend (HCCL on Ascend, NCCL on CUDA, gloo on CPU): the
all-reduce after each rowwise layer. Rank 0 tells the other ranks what to run over a second
group on gloo (`tell`/`hear`: small pickled messages, host to host, whatever the device), so the
device's stream only ever carries tensors.
"""

from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as dist

from serve_app.engine.backends.parallel.rendezvous import Rendezvous
from serve_app.engine.errors import RankFailure

# what the device's collectives run on
BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
# how long the ranks wait for each other to join (each loads the model first) and a collective
# for its peers (a hung rank: the replica's health check acts sooner)
JOIN_LIMIT = datetime.timedelta(minutes=30)
# how long a rank waits for rank 0's next order (an idle engine sends none); a rank that dies
# ends its peers' waits at once (their sockets close)
IDLE_LIMIT = datetime.timedelta(days=7)


def _collective(method):
    """Turn a failed collective into a RankFailure that names the world size."""

    @functools.wraps(method)
    def call(self, *args):
        try:
            return method(self, *args)
        except RuntimeError as exc:
            cause = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
            raise RankFailure(self.rank, self.world, cause) from exc

    return call


def backend_name(device: torch.device) -> str:
    return BACKENDS.get(device.type, "gloo")


class RankGroup:
    """This process's place among the ranks: joined at construction, left by close()."""

    def __init__(self, rendezvous: Rendezvous, rank: int, world: int, device: torch.device):
        self.rank, self.world = rank, world
        self.backend = backend_name(device)
        if dist.is_initialized():  # torch.distributed has one default group per process
            raise RuntimeError(
                "this process already runs a model split over ranks (one per process): close "
                "it first (LLM.close())"
            )
        dist.init_process_group(
            self.backend, init_method=rendezvous.url, rank=rank, world_size=world,
            timeout=JOIN_LIMIT,
        )  # fmt: skip
        self.control = dist.new_group(backend="gloo", timeout=IDLE_LIMIT)

    @_collective
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        dist.all_reduce(t)
        return t

    @_collective
    def least(self, n: int) -> int:
        """The smallest of the ranks' `n`, on every rank."""
        t = torch.tensor([n], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    @_collective
    def tell(self, message) -> None:
        """Rank 0: send every other rank `message`."""
        dist.broadcast_object_list([message], src=0, group=self.control)

    @_collective
    def hear(self):
        """Another rank: wait for rank 0's next message."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    @_collective
    def gather(self, item) -> list | None:
        """Every rank's `item`, in rank order, on rank 0 (None elsewhere)."""
        items = [None] * self.world if self.rank == 0 else None
        dist.gather_object(item, items, dst=0, group=self.control)
        return items

    @_collective
    def scatter(self, items: list | None):
        """Rank 0 hands out items[r] to rank r; each rank gets its own."""
        box = [None]
        dist.scatter_object_list(box, items if self.rank == 0 else None, src=0, group=self.control)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
