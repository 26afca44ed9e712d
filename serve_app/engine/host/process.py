"""The engine's step loop in a child process of its own (ModelConfig `engineProcess`).

On a thread, the step loop shares its process's interpreter lock with everything else the
replica does per token (detokenizing, stop strings, streaming chunks out), and waits for it
between the kernels of every step. In a child process it shares nothing: the parent sends
requests and aborts over a socket pair, and gets back one message per step (every request's
outputs plus the engine's stats), read by a thread that hands them to the waiting streams.
Optionally the child binds itself to cores of its own (`engineCpus`), and its torch threads are
those cores.

Messages are pickled by value (KV payloads of PD hand-offs included), so no shared memory
outlives either side. A step's outputs leave out their requests' prompt ids (`prompt_token_ids`
None): the parent has them (`AsyncEngine` puts them back). A streamed output carries only its new
tokens (`CompletionOutput.token_ids`), so the message does not grow as the outputs do, and as a
tuple of plain values (`outputs.pack_step`), which pickle writes without calling back into
Python (docs/performance.md, "What crosses and what attends"). The child exits when the parent
says stop or goes away (the socket closes).
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from serve_app.engine.config import EngineConfig
from serve_app.engine.host.step_loop import IDLE_WAIT_S, Items, run_steps
from serve_app.engine.outputs import pack_step, unpack_step
from serve_app.placement import bind_process, check_cores, format_cpus

# glibc malloc in the engine process (the environment's own settings win): buffers up to 1 GiB
# come from the heap and freed ones stay there, instead of a fresh mmap (and a page fault per
# 4 KiB) for every buffer over glibc's 32 MiB ceiling, which is every step's logits from ~54
# sequences on with a 151936-word vocabulary: faulting in every page of fresh memory made
# converting the logits to float32 several times slower than reusing heap memory, a cost paid
# every step (docs/performance.md, "The engine process and core placement").
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the engine's owner shows and checks about it, wherever it runs."""

    device: str
    dtype: str
    num_blocks: int
    max_model_len: int
    num_threads: int
    model_path: str
    cpus: tuple[int, ...] = ()  # bound to these cores; () = not bound
    spare_cpus: tuple[int, ...] = ()  # helpers of its CPU GEMMs run on these (idle priority)
    decode_graphs: int = 0  # CUDA: batch sizes whose decode steps replay as graphs
    eos_token_ids: tuple[int, ...] = ()  # the model config's and the tokenizer's
    world_size: int = 1  # ranks the model is split over (this engine's runner is rank 0)

    @classmethod
    def of(cls, engine, cpus: tuple[int, ...] = (), spare_cpus: tuple[int, ...] = ()) -> EngineInfo:
        import torch

        runner = engine.runner
        return cls(
            str(runner.device),
            str(runner.dtype),
            runner.num_blocks,
            engine.max_model_len,
            torch.get_num_threads(),
            str(runner.model_path),
            cpus,
            spare_cpus,
            decode_graphs=len(runner.decode_graphs.sizes) if runner.decode_graphs else 0,
            eos_token_ids=tuple(sorted(engine.eos_token_ids)),
            world_size=engine.config.world_size,
        )

    def placement(self) -> str:
        """' on cores 1, kernel helpers on the idle time of cores 0' ('' when not bound),
        ', split over 2 ranks (worldSize)' and ', decode steps as CUDA graphs (11 batch sizes)'
        where they are."""
        text = f" on cores {format_cpus(self.cpus)}" if self.cpus else ""
        if self.world_size > 1:
            text += f", split over {self.world_size} ranks (worldSize)"
        if self.spare_cpus:
            text += f", kernel helpers on the idle time of cores {format_cpus(self.spare_cpus)}"
        if self.decode_graphs:
            text += f", decode steps as CUDA graphs ({self.decode_graphs} batch sizes)"
        return text


class EngineProcess:
    """The parent's side: starts the child, waits for the model to load, then relays.

    deliver(items) gets each step's outputs (on the reader thread; `prompt_token_ids` None);
    on_exit(message) is called once if the child dies while this side still wants it.
    """

    def __init__(
        self,
        config: EngineConfig,
        deliver: Callable[[Items], None],
        on_exit: Callable[[str], None],
        num_threads: int | None,
    ) -> None:
        self._deliver = deliver
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._closing = False
        self._exited = False
        # A fresh interpreter running this module (not multiprocessing's spawn, which would
        # re-import the caller's __main__), talking over a socket pair.
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        fd = theirs.fileno()
        start = f"from {__name__} import _child_main; _child_main({fd})"
        self._process = subprocess.Popen(
            [sys.executable, "-c", start], pass_fds=(fd,), env={**MALLOC_ENV, **os.environ}
        )
        theirs.close()
        self.send((config, num_threads))
        from serve_app.models.loader import load_tokenizer, tokenizer_eos_ids

        self.tokenizer = None
        kind, payload = self._receive()
        if kind == "path":
            # The tokenizer loads here while the child loads the model (the child has none);
            # the child adds its end-of-sequence id to the model config's before it is ready.
            try:
                self.tokenizer = load_tokenizer(payload)
            except BaseException:
                self._process.kill()
                self._wait(5)
                self._conn.close()
                raise
            self.send(("eos", tokenizer_eos_ids(self.tokenizer)))
            kind, payload = self._receive()
        if kind != "ready":
            code = self._wait(5)
            self._conn.close()
            if kind == "exited":
                raise RuntimeError(f"the engine process exited while loading (exit code {code})")
            raise RuntimeError(f"the engine process failed to start:\n{payload}")
        self.info: EngineInfo = payload["info"]
        self._stats: dict = payload["stats"]
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    @property
    def is_running(self) -> bool:
        return not self._exited and self._process.poll() is None

    @property
    def pid(self) -> int:
        return self._process.pid

    def stats(self) -> dict:
        """The engine's counters as of its last step."""
        return dict(self._stats)

    def send(self, message: tuple[str, object]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:  # the event loop and shutdown may both send
            try:
                self._conn.send_bytes(data)
            except (BrokenPipeError, OSError):  # the child is gone: the reader reports it
                pass

    def shutdown(self, timeout: float = 10) -> None:
        self._closing = True
        self.send(("stop", None))
        if self._wait(timeout) is None:
            self._process.kill()
            self._wait(timeout)
        self._conn.close()

    def _wait(self, timeout: float) -> int | None:
        """The child's exit code, waiting up to `timeout` s for it (None: still running)."""
        try:
            return self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def _recv(self):
        return pickle.loads(self._conn.recv_bytes())

    def _receive(self) -> tuple[str, object]:
        """The child's next start-up message; ("exited", None) if it is gone."""
        try:
            return self._recv()
        except (EOFError, OSError):
            return "exited", None

    def _read(self) -> None:
        while True:
            try:
                packed, self._stats = self._recv()
            except (EOFError, OSError):
                break
            self._deliver(unpack_step(packed))
        self._exited = True
        if not self._closing:
            self._on_exit(f"the engine process exited (exit code {self._wait(5)})")


def _child_main(fd: int) -> None:
    """The child: read its config, bind, load, say ready (or why not), run the step loop."""
    conn = Connection(fd)
    try:
        config, num_threads = pickle.loads(conn.recv_bytes())
        check_cores(config.engine_spare_cpus)  # before binding: then only engine_cpus are
        bind_process(config.engine_cpus)
        import torch

        if threads := len(config.engine_cpus) or num_threads:  # (None: torch's own default)
            torch.set_num_threads(threads)
        from serve_app.engine.backends.cpu.spare_cores import lend_spare_cores
        from serve_app.engine.llm_engine import LLMEngine
        from serve_app.models.loader import resolve_model_path

        _send(conn, ("path", str(resolve_model_path(config.model))))
        engine = LLMEngine(config, with_tokenizer=False)
        kind, eos = pickle.loads(conn.recv_bytes())  # the parent's tokenizer's
        assert kind == "eos", kind
        engine.eos_token_ids = engine.eos_token_ids | eos
        spare = ()  # helpers only for the CPU kernels
        if engine.runner.device.type == "cpu" and lend_spare_cores(config.engine_spare_cpus):
            spare = config.engine_spare_cpus
        info = EngineInfo.of(engine, config.engine_cpus, spare)
        ready = {"info": info, "stats": engine.stats()}
    except BaseException:
        _send(conn, ("failed", traceback.format_exc()))
        return

    # whether the parent sent something, asked before every step: one poll(2) on a poller made
    # once (Connection.poll builds a selector each time, paid on every step in the cold caches
    # the step's kernels leave: docs/performance.md, "A step's outputs, engine process to model
    # replica")
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)

    def receive(idle: bool) -> list:
        messages = []
        try:
            if idle:
                poller.poll(IDLE_WAIT_S * 1000)
            while poller.poll(0):
                messages.append(pickle.loads(conn.recv_bytes()))
        except (EOFError, OSError):  # the parent is gone
            messages.append(("stop", None))
        return messages

    def deliver(items: Items) -> None:
        _send(conn, (pack_step(items), engine.stats()))  # without prompt ids: the parent has them

    _send(conn, ("ready", ready))
    try:
        run_steps(engine, receive, deliver)
    except (BrokenPipeError, EOFError, OSError):  # the parent went away mid-send
        pass
    finally:
        engine.close()  # the other ranks, where the model is split over several


def _send(conn, message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
