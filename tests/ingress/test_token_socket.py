"""The ingress token socket and a replica's links to it, without Ray or a model: what one event
loop turn puts travels as one frame, nothing without the secret is read, and a request whose
chunks cannot all arrive ends with an error instead of hanging."""

from __future__ import annotations

import asyncio
import os
import pickle
import stat
from dataclasses import replace

import pytest

from serve_app.engine.params import SamplingParams
from serve_app.messages import (
    ChoiceDelta,
    ErrorKind,
    ReplicaChunk,
    ReplicaRequest,
    StepInfo,
    TokenLogprobText,
)
from serve_app.token_socket import inbox as token_inbox
from serve_app.token_socket.frame import TOKEN_FRAME, pack_chunks, unpack_chunks
from serve_app.token_socket.inbox import TokenInbox, TokenStreamLost
from serve_app.token_socket.outbox import TokenOutbox

NODE = "node-a"


def request(request_id: str) -> ReplicaRequest:
    return ReplicaRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4))


def chunk(request_id: str, token: int, finished: bool = False) -> ReplicaChunk:
    delta = ChoiceDelta(index=0, token_ids=[token], text=f"<{token}>")
    return ReplicaChunk(request_id, choices=[delta], finished=finished)


class Response:
    """Stands in for a Serve streaming response: yields `items` (a replica streaming through
    Ray), then waits for `ended` before it ends; records cancel()."""

    def __init__(self, items=(), fail: BaseException | None = None) -> None:
        self.items, self.fail = list(items), fail
        self.ended = asyncio.Event()
        self.cancelled = False
        self.read_to_end = False  # its reader took every item and the end
        self.reading_cancelled = False  # its reader was cancelled while it waited

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for item in self.items:
            yield item
        try:
            await self.ended.wait()
        except asyncio.CancelledError:
            self.reading_cancelled = True
            raise
        if self.fail is not None:
            raise self.fail
        self.read_to_end = True

    def cancel(self) -> None:
        self.cancelled = True


async def read_all(stream) -> list[ReplicaChunk]:
    return [c async for c in stream]


def read_one_request(response: Response) -> list[ReplicaChunk]:
    """The chunks of one request through a fresh inbox whose replica answers `response`,
    which has already ended (at most 2 s)."""

    async def run():
        inbox = TokenInbox(NODE)
        response.ended.set()
        try:
            return await asyncio.wait_for(
                read_all(inbox.stream(request("r1"), lambda: response)), 2
            )
        finally:
            inbox.close()

    return asyncio.run(run())


@pytest.mark.parametrize(
    "replica_node, tcp_host",
    [(NODE, None), ("node-b", "127.0.0.1")],  # the Unix socket; TCP from another node
    ids=["unix", "tcp"],
)
def test_the_chunks_of_one_loop_turn_travel_as_one_frame_to_each_request(replica_node, tcp_host):
    async def run():
        inbox, outbox = TokenInbox(NODE, tcp_host=tcp_host), TokenOutbox(replica_node)
        reqs = [request(f"r{i}") for i in range(3)]
        responses = [Response() for _ in reqs]
        streams = [
            inbox.stream(req, lambda r=resp: r) for req, resp in zip(reqs, responses, strict=True)
        ]
        readers = [asyncio.ensure_future(read_all(s)) for s in streams]
        while not all(req.reply_to for req in reqs):  # registered, sent with the address
            await asyncio.sleep(0.01)
        link = await outbox.link(reqs[0].reply_to)
        assert link is not None and reqs[0].reply_to.node_id == NODE
        for step in range(3):  # three engine steps: every request gets a chunk in each
            for req in reqs:
                link.put(chunk(req.request_id, step, finished=step == 2))
            await asyncio.sleep(0.01)
        for response in responses:
            response.ended.set()
        got = await asyncio.gather(*readers)
        mode = stat.S_IMODE(os.stat(os.path.dirname(reqs[0].reply_to.path)).st_mode)
        inbox.close()
        outbox.close()
        return inbox, got, responses, mode, reqs[0].reply_to.path

    inbox, got, responses, mode, path = asyncio.run(run())
    assert inbox.tcp_host == tcp_host
    for i, chunks in enumerate(got):
        assert [c.request_id for c in chunks] == [f"r{i}"] * 3
        assert [c.choices[0].token_ids for c in chunks] == [[0], [1], [2]]
        assert [c.finished for c in chunks] == [False, False, True]
    assert inbox.num_frames == 3 and inbox.num_chunks == 9  # one frame per step, not per chunk
    assert not any(r.cancelled for r in responses)  # finished: nothing to cancel
    assert mode == 0o700 and not os.path.exists(path)  # private, and removed by close()


def test_chunks_of_one_request_put_in_one_loop_turn_travel_as_one():
    """The replica's event loop fell behind the engine: two steps' chunks of a request, put in
    the same turn, arrive as one chunk with both tokens (and the final's facts)."""

    async def run():
        inbox, outbox = TokenInbox(NODE), TokenOutbox(NODE)
        req, response = request("r1"), Response()
        reader = asyncio.ensure_future(read_all(inbox.stream(req, lambda: response)))
        while req.reply_to is None:
            await asyncio.sleep(0.01)
        link = await outbox.link(req.reply_to)
        link.put(chunk("r1", 0))
        await asyncio.sleep(0.01)
        link.put(chunk("r1", 1))
        link.put(chunk("r1", 2))
        final = chunk("r1", 3, finished=True)
        final.stats = {"num_running": 0}
        link.put(final, now=True)
        response.ended.set()
        got = await reader
        inbox.close()
        outbox.close()
        return got, inbox

    got, inbox = asyncio.run(run())
    assert [c.choices[0].token_ids for c in got] == [[0], [1, 2, 3]]
    assert got[-1].choices[0].text == "<1><2><3>" and got[-1].finished
    assert got[-1].stats == {"num_running": 0} and inbox.num_chunks == 2


def behind(later) -> list[ReplicaChunk]:
    """Request r1 through an inbox: its first chunk (token 0) is read as soon as it comes, then
    `later(link)` puts more while the consumer is busy elsewhere; everything read."""

    async def run():
        inbox, outbox = TokenInbox(NODE), TokenOutbox(NODE)
        req, response = request("r1"), Response()
        stream = inbox.stream(req, lambda: response)
        first = asyncio.ensure_future(anext(stream))
        while req.reply_to is None:
            await asyncio.sleep(0.01)
        link = await outbox.link(req.reply_to)
        link.put(chunk("r1", 0))
        got = [await first]  # alone, as soon as it came
        await later(link)
        response.ended.set()
        got += await read_all(stream)
        inbox.close()
        outbox.close()
        return got

    return asyncio.run(run())


def test_a_request_that_fell_behind_gets_what_waits_as_one_chunk():
    """Chunks that arrive while the request's consumer is busy come out folded into one; one
    that finds the consumer waiting comes out at once, alone (a first token is never held)."""

    async def three_steps(link):
        for step in (1, 2, 3):
            link.put(chunk("r1", step, finished=step == 3))
            await asyncio.sleep(0.01)

    got = behind(three_steps)
    assert [c.choices[0].token_ids for c in got] == [[0], [1, 2, 3]]
    assert [c.finished for c in got] == [False, True] and got[1].choices[0].text == "<1><2><3>"


def test_an_error_chunk_is_never_folded_into_the_tokens_before_it():
    """Tokens and then an error chunk wait for a busy consumer: the tokens come out first, on
    their own (folded into the error chunk, a stream would drop them), then the error."""

    async def tokens_then_error(link):
        link.put(chunk("r1", 1), now=True)
        link.put(chunk("r1", 2), now=True)
        failed = ReplicaChunk("r1", finished=True, error="engine died", error_kind="engine")
        link.put(failed, now=True)
        await asyncio.sleep(0.05)  # all three wait for the consumer

    got = behind(tokens_then_error)
    assert [c.choices[0].token_ids if c.choices else None for c in got] == [[0], [1, 2], None]
    assert [c.error for c in got] == [None, None, "engine died"]


def test_a_replica_on_another_node_or_without_a_socket_streams_through_ray():
    async def run():
        inbox = TokenInbox(NODE)
        req = request("r1")
        response = Response([chunk("r1", 7), chunk("r1", 8, finished=True)])
        response.ended.set()
        chunks = await read_all(inbox.stream(req, lambda: response))
        elsewhere = await TokenOutbox("node-b").link(req.reply_to)
        nowhere = await TokenOutbox(NODE).link(None)
        inbox.close()
        return chunks, elsewhere, nowhere, inbox

    chunks, elsewhere, nowhere, inbox = asyncio.run(run())
    # both were waiting when the request read: one chunk (see the coalescing test)
    assert [c.choices[0].token_ids for c in chunks] == [[7, 8]] and chunks[-1].finished
    assert elsewhere is None and nowhere is None and inbox.num_frames == 0


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_connection_without_the_secret_is_closed_unread(transport):
    async def run():
        inbox = TokenInbox(NODE, tcp_host="127.0.0.1")
        req = request("r1")
        response = Response()
        reader = asyncio.ensure_future(read_all(inbox.stream(req, lambda: response)))
        for _ in range(200):  # listening (the TCP address is resolved on a worker thread)
            await asyncio.sleep(0.01)
            if req.reply_to is not None:
                break
        address = req.reply_to
        if transport == "unix":
            sock_reader, writer = await asyncio.open_unix_connection(address.path)
        else:
            sock_reader, writer = await asyncio.open_connection(address.host, address.port)
        data = pickle.dumps([chunk("r1", 1, finished=True)])
        writer.write(b"x" * 16 + TOKEN_FRAME.pack(len(data)) + data)
        closed = await asyncio.wait_for(sock_reader.read(), 2)  # the inbox hangs up: b""
        await asyncio.sleep(0.05)
        pending = not reader.done()
        reader.cancel()
        writer.close()
        inbox.close()
        return closed, pending, inbox, response

    closed, pending, inbox, response = asyncio.run(run())
    assert closed == b"" and pending and inbox.num_frames == 0
    assert response.cancelled  # the request left unfinished: cancelled in the replica


def test_a_socket_closed_mid_request_ends_it_with_an_error():
    async def run():
        inbox, outbox = TokenInbox(NODE), TokenOutbox(NODE)
        req = request("r1")
        reader = asyncio.ensure_future(read_all(inbox.stream(req, Response)))
        await asyncio.sleep(0.01)
        link = await outbox.link(req.reply_to)
        link.put(chunk("r1", 1))
        await asyncio.sleep(0.01)
        link.close()  # the replica's process went away
        try:
            await asyncio.wait_for(reader, 2)
        except TokenStreamLost as exc:
            return exc
        finally:
            inbox.close()

    assert "closed mid-request" in str(asyncio.run(run()))


def test_a_final_chunk_that_never_comes_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setattr(token_inbox, "LAST_CHUNK_S", 0.1)
    with pytest.raises(TokenStreamLost, match="without its final chunk"):
        read_one_request(Response())  # the Ray stream ends, no chunk came through the socket


def test_a_replica_failure_through_ray_is_raised_to_the_request():
    with pytest.raises(RuntimeError, match="replica died"):
        read_one_request(Response([chunk("r1", 1)], fail=RuntimeError("replica died")))


def test_leaving_early_cancels_the_request_in_the_replica():
    async def run():
        inbox = TokenInbox(NODE)
        response = Response([chunk("r1", 1)])
        stream = inbox.stream(request("r1"), lambda: response)
        first = await stream.__anext__()
        await stream.aclose()
        inbox.close()
        return first, response

    first, response = asyncio.run(run())
    assert first.choices[0].token_ids == [1] and response.cancelled


def test_a_request_is_forgotten_once_its_final_chunk_is_out():
    """The pipeline does not close a stream that ended with its final chunk: nothing of the
    request may stay behind in the inbox until the generator is garbage collected."""

    async def run():
        inbox = TokenInbox(NODE)
        response = Response([chunk("r1", 1, finished=True)])
        stream = inbox.stream(request("r1"), lambda: response)
        final = await stream.__anext__()  # and the caller never closes it
        left = dict(inbox._queues), dict(inbox._carriers)
        inbox.close()
        return final, left

    final, (queues, carriers) = asyncio.run(run())
    assert final.finished and queues == {} and carriers == {}


def test_a_finished_request_reads_its_ray_stream_to_its_end_instead_of_cancelling_it():
    """The replica ends a request's Ray stream right after its final chunk: cancelling that
    stream while it is still open (a gRPC call cancelled on both sides) cost more than
    reading its end."""

    async def run():
        inbox = TokenInbox(NODE)
        response = Response([chunk("r1", 1, finished=True)])
        chunks = await read_all(inbox.stream(request("r1"), lambda: response))
        await asyncio.sleep(0.05)
        still_open = not response.reading_cancelled and not response.read_to_end
        response.ended.set()  # the replica ends it
        await asyncio.sleep(0.05)
        inbox.close()
        return chunks, still_open, response

    chunks, still_open, response = asyncio.run(run())
    assert chunks[-1].finished and still_open
    assert response.read_to_end and not response.reading_cancelled and not response.cancelled


def test_a_ray_stream_that_does_not_end_after_the_final_chunk_is_cancelled(monkeypatch):
    monkeypatch.setattr(token_inbox, "LAST_CHUNK_S", 0.1)

    async def run():
        inbox = TokenInbox(NODE)
        response = Response([chunk("r1", 1, finished=True)])  # and it never ends
        chunks = await read_all(inbox.stream(request("r1"), lambda: response))
        await asyncio.sleep(0.3)
        inbox.close()
        return chunks, response

    chunks, response = asyncio.run(run())
    assert chunks[-1].finished and response.reading_cancelled


def test_the_replica_releases_and_forgets_the_link_of_an_ingress_that_went_away():
    async def run():
        inbox, outbox = TokenInbox(NODE), TokenOutbox(NODE)
        link = await outbox.link(await inbox.address())
        inbox.close()
        for _ in range(100):
            if not outbox._links:
                break
            await asyncio.sleep(0.01)
        return link, dict(outbox._links)

    link, links = asyncio.run(run())
    assert not link.alive and links == {} and link._writer.is_closing()


def test_a_connection_that_sends_no_secret_is_closed_after_a_while(monkeypatch):
    monkeypatch.setattr(token_inbox, "SECRET_WAIT_S", 0.1)

    async def run():
        inbox = TokenInbox(NODE, tcp_host="127.0.0.1")
        address = await inbox.address()
        reader, writer = await asyncio.open_connection(address.host, address.port)
        closed = await asyncio.wait_for(reader.read(), 2)  # b"": the inbox hung up
        writer.close()
        inbox.close()
        return closed

    assert asyncio.run(run()) == b""


def test_a_connect_that_hangs_streams_through_ray_instead(monkeypatch):
    from serve_app.token_socket import outbox as token_outbox

    async def never(*args, **kwargs):
        await asyncio.sleep(3600)

    monkeypatch.setattr(token_outbox, "CONNECT_S", 0.05)
    monkeypatch.setattr(token_outbox.asyncio, "open_connection", never)

    async def run():
        inbox = TokenInbox(NODE, tcp_host="127.0.0.1")
        address = await inbox.address()
        start = asyncio.get_running_loop().time()
        link = await TokenOutbox("node-b").link(address)
        inbox.close()
        return link, asyncio.get_running_loop().time() - start

    link, took = asyncio.run(run())
    assert link is None and took < 1


def test_the_socket_directory_goes_when_the_process_exits_without_close():
    import subprocess
    import sys

    code = (
        "import asyncio\n"
        "from serve_app.token_socket.inbox import TokenInbox\n"
        "async def main():\n"
        "    print((await TokenInbox('n').address()).path)\n"
        "asyncio.run(main())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    path = run.stdout.strip()
    assert path.endswith("inbox.sock") and not os.path.exists(os.path.dirname(path))


def test_chunks_cross_the_socket_as_their_constructors_arguments():
    """Every streamed chunk is pickled once per step: as constructor arguments (no state dict
    per slotted object, about half the bytes), equal after the round trip."""
    from serve_app.messages import ChoiceDelta, ErrorKind, StepInfo, TokenLogprobText

    logprob = TokenLogprobText(7, -0.25, "a", [(7, "a", -0.25)])
    delta = ChoiceDelta(0, [7], "a", ["a"], [logprob], "stop", "x", 3, -0.25)
    chunk = ReplicaChunk("r", [delta], [StepInfo(32, 10.0, None, 18.0)], True, 5, "e",
                         ErrorKind.ENGINE, {"num_running": 1}, "rep", 1.5, 10, True)  # fmt: skip
    for obj in (chunk, delta, logprob, chunk.steps[0]):
        assert obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)[0] is type(obj)
    assert pickle.loads(pickle.dumps([chunk, chunk])) == [chunk, chunk]


def streamed(request_id: str, token: int) -> ReplicaChunk:
    """A chunk as a replica streams one engine step of a request."""
    delta = ChoiceDelta(0, [token], f"<{token}>", num_output_tokens=token + 1)
    return ReplicaChunk(
        request_id, [delta], [StepInfo(32, 10.0, None, 18.0)], False, 5, replica_id="rep"
    )


def plain(value) -> bool:
    """Whether pickle writes value without calling back into Python."""
    if type(value) in (list, tuple):
        return all(plain(v) for v in value)
    return type(value) in (str, int, float, bool, type(None))


def test_chunks_cross_in_their_flat_form_and_come_back_equal():
    """Every chunk is packed into its flat form (`serve_app.wire`); a streamed one (tokens,
    text, timing) into plain values only, which pickle writes without calling back into
    Python; all come back equal, whatever they carry."""
    more = {
        "finished": True, "error": "e", "error_kind": ErrorKind.ENGINE, "stats": {"n": 1},
        "handoff_ms": 1.5, "kv_bytes": 10, "kv_recomputed": True,
    }  # fmt: skip
    more_choice = {
        "token_texts": ["<1>"], "logprobs": [TokenLogprobText(1, -0.5)], "finish_reason": "stop",
        "stop_reason": "x", "cumulative_logprob": -0.5,
    }  # fmt: skip
    base = streamed("b", 2)
    others = [replace(base, **{name: value}) for name, value in more.items()]
    others += [replace(base, choices=[replace(base.choices[0], **{name: value})])
               for name, value in more_choice.items()]  # fmt: skip
    others += [replace(base, choices=base.choices * 2), replace(base, steps=base.steps * 2)]
    chunks = [streamed("a", 1), *others]
    packed = pack_chunks(chunks)
    assert all(type(p) is tuple for p in packed) and plain(packed[0])
    assert unpack_chunks(pickle.loads(pickle.dumps(packed))) == chunks


def test_streamed_chunks_travel_the_socket_packed(monkeypatch):
    """Through a replica's link, a request's chunks arrive in their flat form (tuples); the
    request reads them as they were put."""
    frames = []

    def unpack(packed):
        frames.append([type(item) is tuple for item in packed])
        return unpack_chunks(packed)

    monkeypatch.setattr(token_inbox, "unpack_chunks", unpack)
    sent = [streamed("r1", 0), streamed("r1", 1), chunk("r1", 2, finished=True)]

    async def run():
        inbox, outbox = TokenInbox(NODE), TokenOutbox(NODE)
        response = Response()
        reader = asyncio.ensure_future(
            read_all(inbox.stream(req := request("r1"), lambda: response))
        )
        while not req.reply_to:
            await asyncio.sleep(0.01)
        link = await outbox.link(req.reply_to)
        for c in sent:
            link.put(c)
            await asyncio.sleep(0.01)
        response.ended.set()
        got = await reader
        inbox.close()
        outbox.close()
        return got

    assert asyncio.run(run()) == sent
    assert frames == [[True], [True], [True]]


def test_a_mailbox_hands_its_reader_items_in_order_and_survives_a_cancelled_wait():
    async def run():
        box = token_inbox.Mailbox()
        box.put_nowait(1)
        box.put_nowait(2)
        got = [await box.get(), box.get_nowait()]
        assert box.empty()
        waiting = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        box.put_nowait(3)  # wakes the waiting reader
        got.append(await asyncio.wait_for(waiting, 1))
        cancelled = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        cancelled.cancel()  # a request whose reader left: nothing is lost for a later one
        await asyncio.gather(cancelled, return_exceptions=True)
        box.put_nowait(4)
        got.append(await asyncio.wait_for(box.get(), 1))
        return got

    assert asyncio.run(run()) == [1, 2, 3, 4]
