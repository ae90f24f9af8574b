"""The forward stage's HTTP client: one POST at a time per kept-alive connection to a replica,
the answer parsed by httptools (llhttp, the parser aiohttp and uvicorn use), nothing else.

aiohttp's `ClientSession` is general: a request and a response object with many fields, a task
writing each body, tracing hooks, cookies, URL building, a timer rescheduled on every read. On
this machine a pass-through built on it costs ~590,000 instructions per short request, and the
same pass-through with this client ~255,000 (`loadtest.bench_instructions`): more than half of a
proxy's cost was the general client. Forwarding needs one request shape, so it gets its own
client; health checks, `/metrics` reads and adapter lists (a few GETs a second) stay on aiohttp,
in sessions made only by `replica_session`.

What it guarantees, as aiohttp did for the forward stage:
- Time-outs: `connect_s` for a new connection; `read_s` for any silence from the replica,
  before the head or between chunks (`ExchangeTimeout`, a `TimeoutError`).
- Failures before the response head (cannot connect, closed or reset before answering) are
  `Refused`: the replica never answered, the caller may try another. A kept connection the
  replica closed as the request went out (the keep-alive race) is first replaced by a new one,
  once. After the head, a broken answer is a `BrokenAnswer`.
- Bounds a hostile replica cannot move: the head at most `MAX_HEAD_BYTES` and `MAX_HEADERS`
  fields, the body buffered at most `HIGH_WATER` bytes ahead of its reader (reading pauses).
- No header injection: a name or value with CR or LF is refused before anything is sent.
- No redirect is followed, by either client: a replica that answers 3xx would have the gateway
  fetch (and relay to a tenant) whatever its `Location` names, another local service included.
  A redirect is a broken answer here and a `Redirected` error from `replica_session`'s sessions
  (a middleware every request of theirs passes through, so a new call cannot forget it): to the
  client, a 502.
- `Answer.close()` closes the connection, which is how vLLM learns to abort a generation;
  `release()` keeps it for the next request only after a whole answer the replica let it keep.
- A `Cancel` handed to `post` ends the exchange from outside the task that reads it (the
  gateway's own decision, preemption): its reader raises `Cancelled` at once and the connection
  closes, while the task itself runs on to tell its client, which cancelling it could not.
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
from collections import deque
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import aiohttp
import httptools
from multidict import CIMultiDict, CIMultiDictProxy

log = logging.getLogger("gateway.upstream")

MAX_HEAD_BYTES = 65536  # a replica's status line and headers; vLLM sends a few hundred bytes
MAX_HEADERS = 256
HIGH_WATER = 1 << 18  # body bytes buffered before reading from the replica pauses
# An idle connection older than this is closed, not reused: vLLM's server (uvicorn) closes
# its side after 5 s idle (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), and a request sent as it does so
# would be refused for nothing.
KEEPALIVE_S = 4.0
# A kept connection lost within this of the request, nothing heard on it, was closed by the
# replica as the request went out (the close crossed it: it arrives within a round trip). Seen
# later, it is a refusal as any other loss: an event loop held past this (LLMEventLoopLagHigh)
# makes the race one too.
RACE_S = 0.1
CHUNK_COST = 64  # bytes a buffered chunk costs beyond its payload (object, deque slot)
MAX_TARGETS = 1024  # replica URLs remembered: past it, those with no kept connection go


_NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


class ExchangeError(Exception):
    """The HTTP exchange with a replica failed."""


class Refused(ExchangeError):
    """No answer: the connection failed, or closed before the response head."""


class BrokenAnswer(ExchangeError):
    """A malformed head, over the bounds, or an answer cut short."""


class ExchangeTimeout(ExchangeError, TimeoutError):
    """`connect_s` or `read_s` passed."""


class Cancelled(ExchangeError):
    """The gateway ended the exchange itself (`Cancel`): no failure of the replica's."""


class Redirected(aiohttp.ClientResponseError):
    """A replica answered a `replica_session` request with a redirect, which is not followed."""


def _redirect(status: int) -> bool:
    return 300 <= status < 400


async def _refuse_redirects(
    request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
) -> aiohttp.ClientResponse:
    response = await handler(request)
    if _redirect(response.status):
        response.close()
        raise Redirected(
            response.request_info,
            response.history,
            status=response.status,
            message="a replica's redirect is not followed",
        )
    return response


def replica_session(
    tls: ssl.SSLContext | None = None,
    timeout: aiohttp.ClientTimeout | None = None,
    connector: aiohttp.BaseConnector | None = None,
) -> aiohttp.ClientSession:
    """A session for the gateway's own requests to replicas (health, `/metrics`, adapter lists,
    stored responses, KV-event sources), and a pod's parent's to its workers (`connector`, their
    Unix sockets): every answer passes `_refuse_redirects` before aiohttp could follow it. `tls`
    verifies https:// replicas (None: the system's trust store)."""
    return aiohttp.ClientSession(
        connector=connector or aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ssl=tls or True),
        timeout=timeout or aiohttp.client.DEFAULT_TIMEOUT,
        auto_decompress=False,
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
        middlewares=(_refuse_redirects,),
    )


@dataclass(frozen=True, slots=True)
class _Target:
    host: str
    port: int
    tls: bool
    prefix: str  # the replica URL's own path, before the request's
    host_header: str

    @classmethod
    def of(cls, url: str) -> _Target:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        assert parts.hostname, url  # the policy refuses a replica URL without one
        port = parts.port or (443 if tls else 80)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        default = port == (443 if tls else 80)
        return cls(
            parts.hostname, port, tls, parts.path.rstrip("/"), host if default else f"{host}:{port}"
        )


def _request_head(target: _Target, path: str, headers: CIMultiDict[str], length: int) -> bytes:
    lines = [f"POST {target.prefix}{path} HTTP/1.1", f"Host: {target.host_header}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"Content-Length: {length}")
    head = "\r\n".join(lines)
    # Two counts in C instead of a check per field: the only line breaks are the joins.
    if head.count("\r") != len(lines) - 1 or head.count("\n") != len(lines) - 1:
        raise ValueError("a header name or value holds a line break")
    return head.encode("utf-8", "surrogateescape") + b"\r\n\r\n"


class _Connection(asyncio.Protocol):
    """One connection to a replica and the exchange it is in, if any."""

    def __init__(self, loop: asyncio.AbstractEventLoop, url: str, idle: list[_Connection]) -> None:
        self.loop, self.url = loop, url
        self.idle = idle  # the list it waits in between requests
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.paused = False  # reading, while the answer's reader is behind by HIGH_WATER
        self.idle_since = 0.0
        self._answer: Answer | None = None
        self._head_bytes = 0
        self._framing = 0  # after the head: bytes read that were not body (chunk lines, trailers)
        self._informational = False  # a 1xx head was read: its message is not the answer
        self._fields: list[tuple[bytes, bytes]] = []
        self._field_bytes = 0

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not registered as `asyncio.Transport`: no isinstance check.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        answer = self._answer
        if answer is None:  # nothing asked: a replica talking out of turn is not reused
            self.close()
            return
        answer.heard_at = self.loop.time()
        before = not answer.head_done
        if before:
            self._head_bytes += len(data)
        else:
            self._framing += len(data)  # on_body takes the body's share back
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(BrokenAnswer("the replica switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(BrokenAnswer(f"the replica's answer is not valid HTTP/1.1: {exc}"))
        else:
            if before and not answer.head_done and self._head_bytes > MAX_HEAD_BYTES:
                self._fail(BrokenAnswer(f"the replica's head is over {MAX_HEAD_BYTES} bytes"))
            elif self._framing > MAX_HEAD_BYTES:  # chunk extensions or trailers, not body
                self._fail(BrokenAnswer(f"the replica's framing is over {MAX_HEAD_BYTES} bytes"))

    @property
    def heard(self) -> bool:
        """Whether the replica sent anything in this exchange before its answer's head."""
        return self._head_bytes > 0

    def eof_received(self) -> bool:
        return False  # close: an exchange is one request and its whole answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._answer is not None:
            self._answer.lost(exc)
            self._answer = None
        elif self in self.idle:  # its replica closed it while idle
            self.idle.remove(self)

    # --- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._answer is None or self._answer.head_done:
            self._fail(BrokenAnswer("the replica sent a second answer"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._answer is not None and self._answer.head_done:
            return  # a trailer: vLLM sends none, and a proxy passes on no late header
        self._fields.append((name, value))
        self._field_bytes += len(name) + len(value)

    def on_headers_complete(self) -> None:
        answer = self._answer
        if answer is None:
            return
        status = self._parser.get_status_code()
        if len(self._fields) > MAX_HEADERS or self._field_bytes > MAX_HEAD_BYTES:
            self._fail(BrokenAnswer(f"the replica's head is over {MAX_HEADERS} fields or bounds"))
        elif status < 200:  # informational (100, 103): the answer follows, as RFC 9110 15.2 says
            self._informational = True
        else:
            answer.started(status, self._fields)
        self._fields, self._field_bytes = [], 0

    def on_body(self, body: bytes) -> None:
        # Its bytes, and 16 for the chunk line and CRLFs around it (each chunk has at least one
        # call): counted here rather than in a callback per chunk, which would cost as much.
        self._framing -= len(body) + 16
        if self._answer is not None:
            self._answer.feed(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        if self._answer is not None:
            self._answer.complete(self._parser.should_keep_alive())

    # --- the gateway's side --------------------------------------------------------------------

    def begin(self, answer: Answer) -> None:
        self._answer, self._head_bytes, self._framing = answer, 0, 0
        self._fields, self._field_bytes = [], 0

    def end(self) -> None:
        self._answer = None

    def pause(self) -> None:
        if self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: ExchangeError) -> None:
        """End the exchange with `exc` (unless its answer was whole already) and the connection:
        whatever the parser still finds in this read goes to no answer."""
        if self._answer is not None:
            self._answer.lost(exc)
            self._answer = None
        self.close()


class Answer:
    """A replica's answer: its status and head, and its body chunk by chunk as it arrives."""

    __slots__ = ("_body", "_buffered", "_conn", "_deadline", "_done", "_ended", "_error", "_keep",
                 "_loop", "_read_s", "_upstream", "_waiter", "_watch", "_watch_at",
                 "content_length", "content_type", "head_done", "headers", "heard_at",
                 "status")  # fmt: skip

    def __init__(self, upstream: Upstream, conn: _Connection, read_s: float | None) -> None:
        self._upstream, self._conn, self._read_s = upstream, conn, read_s
        self._loop = conn.loop
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._done = False  # released or closed: the connection is no longer this answer's
        self._ended = False  # the whole body arrived
        self._keep = False  # and the replica lets the connection be reused
        self._error: ExchangeError | None = None
        self._waiter: asyncio.Future[None] | None = None  # for the head, then for the body
        self._deadline = math.inf  # the reader's own, for the wait at hand (`read_chunk`)
        self._watch: asyncio.TimerHandle | None = None
        self._watch_at = math.inf
        self.head_done = False
        self.heard_at = self._loop.time()
        self.status = 0
        self.headers = _NO_HEADERS
        self.content_type = ""
        self.content_length: int | None = None

    # --- from the connection -------------------------------------------------------------------

    def started(self, status: int, fields: list[tuple[bytes, bytes]]) -> None:
        headers: CIMultiDict[str] = CIMultiDict(
            (name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))
            for name, value in fields
        )
        self.status, self.headers, self.head_done = status, CIMultiDictProxy(headers), True
        self.content_type = headers.get("Content-Type", "").partition(";")[0].strip().lower()
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self._wake(self._waiter)

    def feed(self, chunk: bytes) -> None:
        self._body.append(chunk)
        self._buffered += len(chunk) + CHUNK_COST
        if self._buffered > HIGH_WATER:
            self._conn.pause()
        self._wake(self._waiter)

    def complete(self, keep_alive: bool) -> None:
        self._ended, self._keep = True, keep_alive
        self._wake(self._waiter)

    def lost(self, exc: BaseException | None) -> None:
        if self._ended or self._error is not None:
            return
        if isinstance(exc, ExchangeError):
            self._error = exc
        elif not self.head_done:
            self._error = Refused(f"the replica closed the connection before answering ({exc})")
        elif (
            exc is None
            and self.content_length is None
            and "chunked" not in self.headers.get("Transfer-Encoding", "").lower()
        ):  # a body delimited by the close: that was its end
            self._ended = True
        else:
            self._error = BrokenAnswer(f"the replica closed the connection mid-answer ({exc})")
        self._wake(self._waiter)

    def _wake(self, waiter: asyncio.Future[None] | None) -> None:
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- for the forward stage -----------------------------------------------------------------

    # One watchdog timer per answer, not one per wait: a stream of a thousand chunks would
    # otherwise make and cancel a thousand timers (two, with the reader's deadline). It fires at
    # the earliest time a wait could have to end, and looks: silence is measured from the
    # replica's last bytes (`heard_at`, set on every read), so usually it just re-arms.

    def _due(self) -> float:
        silence = self.heard_at + self._read_s if self._read_s is not None else math.inf
        return min(silence, self._deadline)

    def _arm(self) -> None:
        due = self._due()
        if due < self._watch_at:  # sooner than the watchdog looks (or none is armed)
            if self._watch is not None:
                self._watch.cancel()
            self._watch_at = due
            self._watch = self._loop.call_at(due, self._look) if due < math.inf else None

    def _look(self) -> None:
        self._watch, self._watch_at = None, math.inf
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait arms it again
        now = self._loop.time()
        if now >= self._deadline:
            waiter.set_exception(TimeoutError())
        elif self._read_s is not None and now - self.heard_at >= self._read_s:
            waiter.set_exception(ExchangeTimeout(f"the replica was silent for {self._read_s}s"))
        else:
            self._arm()

    async def _wait(self) -> None:
        """Until the connection has news, within `read_s` of the replica's last bytes and the
        reader's deadline."""
        waiter = self._waiter = self._loop.create_future()
        self._arm()
        await waiter

    async def read_head(self, deadline: float = math.inf) -> None:
        if not self.head_done and self._error is None:
            self._deadline = deadline
            await self._wait()
        if self._error is not None:
            raise self._error

    async def read_chunk(self, deadline: float = math.inf) -> bytes:
        """The body's bytes that arrived since the last call, waiting for some; b"" at its end.

        `deadline` (loop time) bounds this read as `read_s` does: a `TimeoutError` when it
        passes, also while bytes are buffered, once the replica sent any after it (a replica
        faster than its client must not outlive `total_s`; one that had finished by then has
        nothing left to do)."""
        if self.heard_at >= deadline:  # no clock read per chunk: the last read's time will do
            raise TimeoutError
        while not self._body:
            if self._error is not None:
                raise self._error
            if self._ended:
                return b""
            self._deadline = deadline
            await self._wait()
        # All that arrived, as one: the parser hands each chunk of a chunked body over on its
        # own (a stream's every event), and a write to the client per event is a system call
        # per event, where aiohttp's `iter_any` coalesced them.
        body = self._body
        chunk = body.popleft() if len(body) == 1 else b"".join(body)
        body.clear()
        self._buffered = 0
        if self._conn.paused:
            self.heard_at = self._loop.time()  # its silence while paused was ours
            self._conn.resume()
        return chunk

    @property
    def buffered(self) -> int:
        """Body received and not read yet, in bytes with each chunk's `CHUNK_COST`: at most
        about `HIGH_WATER` plus one read."""
        return self._buffered

    @property
    def over(self) -> bool:
        """Nothing is left to end: the body arrived whole, failed, or the answer is let go."""
        return self._done or self._ended or self._error is not None

    def abort(self, exc: ExchangeError) -> bool:
        """End the answer now, from outside its reader: the wait under way (or the next) raises
        `exc`, what is buffered is dropped, and the connection closes, so the replica stops as
        it does for a client that left. False when the answer was `over` already."""
        if self.over:
            return False
        self._error = exc
        self._body.clear()
        self._buffered = 0
        self._wake(self._waiter)
        self.close()
        return True

    def _unwatch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch, self._watch_at = None, math.inf

    def close(self) -> None:
        """Close the connection: the replica stops working on the request."""
        if self._done:
            return
        self._done = True
        self._unwatch()
        self._conn.end()
        self._conn.close()

    def release(self) -> None:
        """Done with the answer: its connection is kept when it can serve another request.
        After `close` or a first `release`, nothing: the connection may serve another by then."""
        if self._done:
            return
        self._done = True
        self._unwatch()
        conn = self._conn
        conn.end()
        if self._ended and self._keep and not self._body and not conn.closed:
            self._upstream.keep(conn)
        elif not conn.closed:
            conn.close()


class Cancel:
    """A request's exchange, to be ended from outside the task that reads it (`Upstream.post`).

    Not the task's cancellation: that reads as the client leaving, and leaves nobody to tell
    the client why. Cancelled before its exchange began, the exchange raises `Cancelled` before
    a byte is sent; during it, the answer is aborted (`Answer.abort`)."""

    __slots__ = ("_answer", "cancelled")

    def __init__(self) -> None:
        self._answer: Answer | None = None
        self.cancelled = False

    @property
    def over(self) -> bool:
        """Cancelled already, or its answer is over: cancelling it would end nothing."""
        return self.cancelled or (self._answer is not None and self._answer.over)

    def cancel(self) -> bool:
        """End the exchange (now, or as it begins); False when there was nothing to end."""
        if self.over:
            return False
        if self._answer is None:
            self.cancelled = True
        else:
            self.cancelled = self._answer.abort(Cancelled("the gateway cancelled the request"))
        return self.cancelled

    def watch(self, answer: Answer) -> None:
        """`answer` is the exchange's now; raises `Cancelled` if that was ended before it began."""
        if self.cancelled:
            raise Cancelled("the gateway cancelled the request before it was sent")
        self._answer = answer


class Upstream:
    """Kept-alive connections to a pool's replicas, by replica URL."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self._targets: dict[str, _Target] = {}
        self._idle: dict[str, list[_Connection]] = {}
        self.tls = tls  # https:// replicas are verified with it; None: the system's trust store
        self._closed = False

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= MAX_TARGETS:  # DNS churn: forget replicas with nothing kept
                for gone in [u for u in self._targets if not self._idle.get(u)]:
                    del self._targets[gone]
                    self._idle.pop(gone, None)
            target = self._targets[url] = _Target.of(url)
        return target

    async def _connect(
        self, url: str, target: _Target, idle: list[_Connection], connect_s: float
    ) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if target.tls:
            tls = self.tls = self.tls or ssl.create_default_context()
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop, url, idle), target.host, target.port, ssl=tls
                )
        except TimeoutError:
            raise ExchangeTimeout(f"no connection within {connect_s}s") from None
        except OSError as exc:
            raise Refused(f"cannot connect: {exc}") from None
        return conn

    async def post(
        self,
        replica_url: str,
        path: str,
        headers: CIMultiDict[str],
        body: bytes,
        connect_s: float,
        read_s: float | None,
        deadline: float = math.inf,
        cancel: Cancel | None = None,
    ) -> Answer:
        """Send one POST and wait for the answer's head, by `deadline` (loop time) and within
        `read_s` of silence; the caller reads the body, then `release`s or `close`s the answer.
        `cancel`, when given, ends the exchange from outside (`Cancelled`).

        A kept-alive connection the replica closes just as the request goes out (its idle
        time-out ran out first, or it restarted) answers nothing: the request goes once more, on
        a new connection, so a one-replica pool does not turn that race into a 502. Only that
        race: nothing heard on the connection, and its loss within `RACE_S` of the request (a
        replica that dropped a request it worked on is the pool's to retry elsewhere), with
        time left. A new connection refused, or not made in time, is the replica's answer."""
        target = self._target(replica_url)
        head = _request_head(target, path, headers, len(body))
        idle = self._idle.get(replica_url)
        if idle is None:
            idle = self._idle[replica_url] = []
        conn = _reusable(idle)
        if conn is not None:
            sent = conn.loop.time()
            try:
                return await self._exchange(conn, head, body, read_s, deadline, cancel)
            except Refused as refused:
                now = conn.loop.time()
                if conn.heard or now - sent > RACE_S or now >= deadline:
                    raise
                log.debug("%s closed a kept connection as a request went out on it", replica_url)
                try:
                    conn = await self._connect(replica_url, target, idle, connect_s)
                except ExchangeTimeout:  # nothing sent on a new connection either: still refused
                    raise refused from None
        else:
            conn = await self._connect(replica_url, target, idle, connect_s)
        if conn.closed:  # lost before it could be used: nothing will wake its answer
            raise Refused("the replica closed the connection before the request")
        return await self._exchange(conn, head, body, read_s, deadline, cancel)

    async def _exchange(
        self,
        conn: _Connection,
        head: bytes,
        body: bytes,
        read_s: float | None,
        deadline: float,
        cancel: Cancel | None,
    ) -> Answer:
        assert conn.transport is not None
        answer = Answer(self, conn, read_s)
        conn.begin(answer)
        try:
            if cancel is not None:
                cancel.watch(answer)
            conn.transport.write(head + body)
            await answer.read_head(deadline)
            if _redirect(answer.status):
                raise BrokenAnswer(
                    f"the replica answered {answer.status}, a redirect: not followed"
                )
        except BaseException:
            answer.close()
            raise
        return answer

    def keep(self, conn: _Connection) -> None:
        idle, now = conn.idle, conn.loop.time()
        if self._closed or self._idle.get(conn.url) is not idle:  # or its replica forgotten
            conn.close()
            return
        conn.idle_since = now
        idle.append(conn)
        if now - idle[0].idle_since > KEEPALIVE_S:  # the oldest has idled long enough
            idle.pop(0).close()

    def close(self) -> None:
        """Close the idle connections now, and each busy one when its exchange ends: its pool
        (or the gateway) is gone, and its requests in flight finish on theirs."""
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
            idle.clear()


def _reusable(idle: list[_Connection]) -> _Connection | None:
    """The newest idle connection still open and younger than `KEEPALIVE_S`; the rest it passes
    over are closed (all older than a stale one are stale too)."""
    if not idle:
        return None
    now = idle[-1].loop.time()
    while idle:
        conn = idle.pop()
        if conn.closed:
            continue
        if now - conn.idle_since > KEEPALIVE_S:
            conn.close()
            continue
        return conn
    return None
