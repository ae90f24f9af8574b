"""The forward stage's HTTP client against hand-written replicas on loopback: what it reuses, what
it refuses, and where a hostile or silent replica stops it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from multidict import CIMultiDict

from gateway.upstream import (
    HIGH_WATER,
    MAX_HEAD_BYTES,
    RACE_S,
    BrokenAnswer,
    Cancel,
    Cancelled,
    ExchangeTimeout,
    Refused,
    Upstream,
)
from tests.conftest import paced

JSON = b'{"ok":true}'
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n" + JSON
Script = Callable[["Replica", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Replica:
    """A raw TCP server: each connection runs `script`; it counts connections and requests."""

    script: Script
    url: str = ""
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        return request


@pytest.fixture
async def replica() -> AsyncIterator[Callable[[Script], Awaitable[Replica]]]:
    servers: list[asyncio.Server] = []

    async def start(script: Script) -> Replica:
        made = Replica(script)
        server = await asyncio.start_server(made.serve, "127.0.0.1", 0)
        servers.append(server)
        made.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return made

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def answer_each(
    made: Replica, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """A replica that answers every request on the connection with `OK`."""
    while True:
        await made.read_request(reader)
        writer.write(OK)


def writes_once(data: bytes, hold: bool = False) -> Script:
    """A replica that reads one request and writes `data` (b"": nothing), then hangs up, or with
    `hold` keeps the connection until the client closes it."""

    async def script(
        made: Replica, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await made.read_request(reader)
        writer.write(data)
        await writer.drain()
        if hold:
            await reader.read()

    return script


async def send_chunked(writer: asyncio.StreamWriter, parts: list[bytes], gap_s: float) -> None:
    """A chunked answer's head and `parts` as chunks, `gap_s` apart; no final chunk."""
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    for part in parts:
        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
        await writer.drain()
        await asyncio.sleep(gap_s)


async def post(
    upstream: Upstream, replica: Replica, read_s: float | None = 5.0
) -> tuple[int, bytes]:
    answer = await upstream.post(
        replica.url, "/v1/chat/completions", CIMultiDict(), b"{}", 1.0, read_s
    )
    body = b""
    try:
        while chunk := await answer.read_chunk():
            body += chunk
    except BaseException:
        answer.close()
        raise
    answer.release()
    return answer.status, body


async def test_a_kept_alive_connection_serves_the_next_request(replica) -> None:
    made = await replica(answer_each)
    upstream = Upstream()
    for _ in range(3):
        assert await post(upstream, made) == (200, JSON)
    assert made.connections == 1
    request = made.requests[0]
    assert request.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert f"Host: {made.url.removeprefix('http://')}".encode() in request
    assert request.endswith(b"Content-Length: 2\r\n\r\n{}")
    upstream.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 11\r\n\r\n" + JSON,
        b"HTTP/1.1 200 OK\r\n\r\n" + JSON,  # delimited by the close
    ],
)
async def test_a_connection_the_replica_closes_is_not_reused(replica, answer: bytes) -> None:
    made = await replica(writes_once(answer))
    upstream = Upstream()
    assert await post(upstream, made) == (200, JSON)
    assert await post(upstream, made) == (200, JSON)
    assert made.connections == 2


async def test_a_chunked_answer_is_read_whole(replica) -> None:
    async def chunked(
        made: Replica, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await made.read_request(reader)
        await send_chunked(writer, [b'{"ok"', b":true}"], 0.01)
        writer.write(b"0\r\n\r\n")
        await reader.read()

    made = await replica(chunked)
    assert await post(Upstream(), made) == (200, JSON)


async def test_no_answer_at_all_is_refused(replica) -> None:
    made = await replica(writes_once(b""))
    with pytest.raises(Refused):
        await post(Upstream(), made)
    assert made.connections == 1  # a new connection refused is the answer: not tried again
    with pytest.raises(Refused, match="cannot connect"):
        await Upstream().post("http://127.0.0.1:1", "/", CIMultiDict(), b"", 1.0, 1.0)


@pytest.mark.parametrize(
    ("second", "sent_again"),
    [
        ("hung up at once", True),  # the keep-alive race: the replica ended an idle connection
        ("worked on", False),  # read it, worked past the race's window, then hung up
        ("heard from", False),  # began an answer, then hung up
    ],
)
async def test_only_the_keep_alive_race_is_sent_again_on_a_new_connection(
    replica, second: str, sent_again: bool
) -> None:
    """The replica hangs up on the kept connection's second request. Only the race is sent once
    more, anew; any other loss is a refusal the pool may take to another replica."""

    async def then_hang_up(
        made: Replica, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await made.read_request(reader)
        writer.write(OK)
        await writer.drain()
        await made.read_request(reader)
        if second == "worked on":
            await asyncio.sleep(RACE_S * 3)
        elif second == "heard from":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-")
            await writer.drain()

    made = await replica(then_hang_up)
    upstream = Upstream()
    assert await post(upstream, made) == (200, JSON)
    if sent_again:
        assert await post(upstream, made) == (200, JSON)
        assert made.connections == 2 and len(made.requests) == 3
    else:
        with pytest.raises(Refused):
            await post(upstream, made)
        assert made.connections == 1 and len(made.requests) == 2


async def test_no_new_connection_in_time_after_the_race_is_still_a_refusal() -> None:
    """The replica hangs up on the kept connection and takes no new one (its accept queue is
    full: a pod gone, a backlog overflowing): nothing was sent anew, so the pool may try
    another replica, as before the retry existed, not a time-out."""
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    url, waiting = f"http://127.0.0.1:{port}", []
    upstream = Upstream()
    try:
        first = asyncio.create_task(upstream.post(url, "/", CIMultiDict(), b"{}", 0.2, 5.0))
        accepted, _ = await loop.sock_accept(listener)
        reader, writer = await asyncio.open_connection(sock=accepted)
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(OK)
        answer = await first
        assert await answer.read_chunk() == JSON
        answer.release()
        for _ in range(3):  # fill the accept queue: later connection attempts go unanswered
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            waiting.append(sock)

        async def hang_up() -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.close()

        closer = asyncio.create_task(hang_up())
        with pytest.raises(Refused, match="before answering"):
            await upstream.post(url, "/", CIMultiDict(), b"{}", 0.2, 5.0)
        await closer
    finally:
        for sock in waiting:
            sock.close()
        listener.close()
        upstream.close()


async def test_an_answer_cut_short_is_broken(replica) -> None:
    made = await replica(writes_once(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + JSON))
    with pytest.raises(BrokenAnswer, match="mid-answer"):
        await post(Upstream(), made)


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * (2 * MAX_HEAD_BYTES) + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"X-Pad: a\r\n" * 1000 + b"Content-Length: 0\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n",
        b"not http at all\r\n\r\n",
    ],
)
async def test_a_hostile_head_is_refused_and_its_connection_closed(replica, head: bytes) -> None:
    made = await replica(writes_once(head, hold=True))
    upstream = Upstream()
    with pytest.raises(BrokenAnswer):
        await post(upstream, made)
    await asyncio.sleep(0.05)
    assert not any(upstream._idle.values())  # nothing kept to reuse


async def test_a_second_answer_to_one_request_costs_the_connection(replica) -> None:
    made = await replica(writes_once(OK + OK, hold=True))
    upstream = Upstream()
    assert await post(upstream, made) == (200, JSON)  # the first is the answer
    assert await post(upstream, made) == (200, JSON)
    assert made.connections == 2  # the one that spoke out of turn was not reused


async def test_silence_before_the_head_and_between_chunks_times_out(replica) -> None:
    made = await replica(writes_once(b"", hold=True))
    with pytest.raises(ExchangeTimeout):
        await post(Upstream(), made, read_s=0.2)

    stalling = await replica(
        writes_once(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + JSON, hold=True)
    )
    with pytest.raises(ExchangeTimeout, match="silent"):
        await post(Upstream(), stalling, read_s=0.2)


async def test_a_head_that_keeps_arriving_is_not_silence(replica) -> None:
    async def trickle(
        made: Replica, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await made.read_request(reader)
        for byte in OK[:40]:  # 40 bytes over ~0.6 s, each well within read_s
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.015)
        writer.write(OK[40:])
        await reader.read()

    made = await replica(trickle)
    assert await post(Upstream(), made, read_s=0.25) == (200, JSON)


async def test_a_reader_that_does_not_read_holds_a_bounded_buffer(replica) -> None:
    size = 16 * HIGH_WATER

    async def flood(
        made: Replica, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await made.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()

    made = await replica(flood)
    answer = await Upstream().post(made.url, "/", CIMultiDict(), b"{}", 1.0, 5.0)
    await asyncio.sleep(0.3)  # the replica writes as fast as it is let
    assert answer.buffered <= HIGH_WATER + (1 << 18)  # + at most one read of the transport
    total = 0
    while chunk := await answer.read_chunk():
        total += len(chunk)
    answer.release()
    assert total == size


async def test_a_line_break_in_a_header_is_never_sent(replica) -> None:
    async def record(
        made: Replica, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await made.read_request(reader)

    made = await replica(record)
    headers = CIMultiDict({"Authorization": "Bearer key\r\nX-Injected: yes"})
    with pytest.raises(ValueError, match="line break"):
        await Upstream().post(made.url, "/", headers, b"{}", 1.0, 1.0)
    await asyncio.sleep(0.05)
    assert made.requests == []


@pytest.fixture
def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, and its key."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


async def test_an_https_replica_is_verified_and_served(self_signed, monkeypatch) -> None:
    """TLS with the system's verification: the replica's certificate must be trusted (here a
    self-signed one, through `SSL_CERT_FILE`) and name the host."""
    cert, key = self_signed
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)

    async def answer(
        made: Replica, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await made.read_request(reader)
        writer.write(OK)
        await reader.read()

    made = Replica(answer)
    server = await asyncio.start_server(made.serve, "127.0.0.1", 0, ssl=server_tls)
    made.url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        with pytest.raises(Refused, match="certificate"):  # not trusted yet
            await post(Upstream(), made)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        assert await post(Upstream(), made) == (200, JSON)
    finally:
        server.close()
        await server.wait_closed()


async def test_replicas_dns_no_longer_names_are_forgotten(replica, monkeypatch) -> None:
    made = await replica(answer_each)
    monkeypatch.setattr("gateway.upstream.MAX_TARGETS", 3)
    upstream = Upstream()
    assert await post(upstream, made) == (200, JSON)  # one connection kept for it
    for n in range(10):  # replicas that came and went, never answering
        with pytest.raises(Refused):
            await upstream.post(f"http://127.0.0.{n + 2}:1", "/", CIMultiDict(), b"", 1.0, 1.0)
    assert len(upstream._targets) <= 3
    assert made.url in upstream._targets  # its kept connection keeps it
    assert await post(upstream, made) == (200, JSON)
    assert made.connections == 1


async def test_a_stream_that_never_goes_silent_still_ends_at_the_readers_deadline(replica) -> None:
    async def forever(
        made: Replica, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await made.read_request(reader)
        await send_chunked(writer, [b"data: "] * 200, 0.02)  # ~4 s, far past the deadline

    made = await replica(forever)
    answer = await Upstream().post(made.url, "/", CIMultiDict(), b"{}", 1.0, 0.2)
    deadline = asyncio.get_running_loop().time() + 0.5

    async def read() -> tuple[int, BaseException]:
        chunks = 0
        with pytest.raises(TimeoutError) as caught:
            while await answer.read_chunk(deadline):
                chunks += 1
        return chunks, caught.value

    (chunks, caught), pace = await paced(read(), tick_s=0.002)
    answer.close()
    assert not isinstance(caught, ExchangeTimeout)  # the deadline, not silence (read_s)
    # Ended at the deadline: what it waited, the machine's pauses aside, is not the ~4 s stream.
    assert chunks > 5 and pace.waited < 1.0, pace


@pytest.mark.parametrize(
    "informational",
    [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"],
)
async def test_an_informational_head_is_skipped_for_the_answer(replica, informational) -> None:
    async def hint_first(made: Replica, reader: asyncio.StreamReader, writer) -> None:
        while True:
            await made.read_request(reader)
            writer.write(informational + OK)

    made = await replica(hint_first)
    upstream = Upstream()
    answer = await upstream.post(made.url, "/", CIMultiDict(), b"{}", 1.0, 1.0)
    assert (answer.status, answer.headers.get("Link")) == (200, None)
    assert await answer.read_chunk() == JSON
    answer.release()
    assert await post(upstream, made) == (200, JSON)
    assert made.connections == 1


async def test_trailers_reach_no_answer_and_are_bounded(replica) -> None:
    async def trailers(made: Replica, reader: asyncio.StreamReader, writer) -> None:
        await made.read_request(reader)
        await send_chunked(writer, [JSON], 0)
        writer.write(b"0\r\nX-Trailer: evil\r\nContent-Type: text/evil\r\n\r\n")
        await made.read_request(reader)  # the same connection, kept
        writer.write(OK)
        await made.read_request(reader)
        await send_chunked(writer, [JSON], 0)
        writer.write(b"0\r\nX-Pad: " + b"a" * (4 * MAX_HEAD_BYTES))  # a trailer without end
        await reader.read()

    made = await replica(trailers)
    upstream = Upstream()
    assert await post(upstream, made) == (200, JSON)
    answer = await upstream.post(made.url, "/", CIMultiDict(), b"{}", 1.0, 1.0)
    assert "X-Trailer" not in answer.headers and answer.content_type == "application/json"
    assert await answer.read_chunk() == JSON
    answer.release()
    with pytest.raises(BrokenAnswer, match="framing"):
        await post(upstream, made)
    assert made.connections == 1


async def test_an_idle_connection_past_keepalive_is_not_reused(replica, monkeypatch) -> None:
    monkeypatch.setattr("gateway.upstream.KEEPALIVE_S", 0.1)
    made = await replica(answer_each)
    upstream = Upstream()
    assert await post(upstream, made) == (200, JSON)
    await asyncio.sleep(0.2)
    assert await post(upstream, made) == (200, JSON)
    assert made.connections == 2


async def test_a_fast_replica_does_not_outlive_the_readers_deadline(replica) -> None:
    async def fast(made: Replica, reader: asyncio.StreamReader, writer) -> None:
        await made.read_request(reader)
        await send_chunked(writer, [b"data: x\n\n"] * 2000, 0.001)

    made = await replica(fast)
    answer = await Upstream().post(made.url, "/", CIMultiDict(), b"{}", 1.0, 1.0)
    deadline = asyncio.get_running_loop().time() + 0.3

    async def read() -> None:
        with pytest.raises(TimeoutError):
            for _ in range(100):  # 5 s at most
                assert await answer.read_chunk(deadline)
                await asyncio.sleep(0.05)  # a slow client: bytes are always buffered by now

    _, pace = await paced(read(), tick_s=0.002)
    answer.close()
    # The first read past the deadline raised (a pause of the client's or two past it, the
    # machine's pauses aside): not 5 s of reads.
    assert pace.waited < 0.3 + 2 * 0.05, pace


async def test_an_answer_released_twice_leaves_the_next_exchange_alone(replica) -> None:
    made = await replica(answer_each)
    upstream = Upstream()
    first = await upstream.post(made.url, "/", CIMultiDict(), b"{}", 1.0, 1.0)
    assert await first.read_chunk() == JSON
    first.release()
    second = await upstream.post(made.url, "/", CIMultiDict(), b"{}", 1.0, 1.0)  # same conn
    first.release()
    first.close()
    assert await second.read_chunk() == JSON
    second.release()
    assert await post(upstream, made) == (200, JSON)  # the connection the first had: still open
    assert made.connections == 1


async def test_a_cancel_ends_the_exchange_from_outside_and_only_while_there_is_one(
    replica,
) -> None:
    """Cancelled before it began, nothing is sent; during it, the read waiting for the next
    chunk raises at once and the replica sees its connection close; after it, nothing."""
    before = Cancel()
    assert before.cancel() and before.over
    made = await replica(answer_each)
    upstream = Upstream()
    with pytest.raises(Cancelled):
        await upstream.post(made.url, "/", CIMultiDict(), b"{}", 1.0, 5.0, cancel=before)
    assert made.requests == []

    hung_up = asyncio.Event()

    async def one_chunk_then_hold(
        made: Replica, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await made.read_request(reader)
        await send_chunked(writer, [b"first"], 0)
        await reader.read()  # until the gateway closes its side
        hung_up.set()

    holding = await replica(one_chunk_then_hold)
    during = Cancel()
    answer = await upstream.post(holding.url, "/", CIMultiDict(), b"{}", 1.0, None, cancel=during)
    assert await answer.read_chunk() == b"first"
    reading = asyncio.create_task(answer.read_chunk())  # no read_s: only the cancel ends it
    await asyncio.sleep(0)
    assert during.cancel() and not during.cancel()  # once
    with pytest.raises(Cancelled):
        await asyncio.wait_for(reading, 5)  # bounded: an abort that wakes nobody fails here
    await asyncio.wait_for(hung_up.wait(), 5)

    after = Cancel()
    finished = await upstream.post(made.url, "/", CIMultiDict(), b"{}", 1.0, 5.0, cancel=after)
    assert await finished.read_chunk() == JSON
    finished.release()
    assert after.over and not after.cancel()
    assert await post(upstream, made) == (200, JSON)  # its connection was kept, untouched
    upstream.close()
