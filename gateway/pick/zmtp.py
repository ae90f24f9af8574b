"""The subscriber's side of ZMTP 3.0, ZeroMQ's wire protocol (rfc.zeromq.org/spec/23), with NULL
security: what following a vLLM replica's PUB socket needs, and every bound a feed needs.

libzmq's own SUB socket cannot be bounded so. It hands a multipart message over only once all
its parts have arrived, however many (a publisher that never ends one grows the subscriber's
memory until it stops), and after refusing a part over ZMQ_MAXMSGSIZE it closes the connection
and never reconnects, saying nothing. Here a frame's size is read before its body, a message
has at most `max_parts` parts, and any breach ends the connection with `Ended`, for the caller
to count and connect again. Version 3.0 is announced, so a newer peer (libzmq 4.3 speaks 3.1)
takes subscriptions as 3.0's messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

_SIGNATURE = b"\xff" + bytes(8) + b"\x7f"
GREETING = _SIGNATURE + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31)
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
READ_LIMIT = 1 << 16  # the stream's own buffer; a frame's body is read to its announced size


class Ended(Exception):
    """The connection is over: `kind` says why (`oversize`, `undecodable`: the publisher broke
    a bound or the protocol; `disconnected`: it closed), for the feed's counts."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _frame(flags: int, body: bytes) -> bytes:
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | _LONG]) + len(body).to_bytes(8, "big") + body


async def subscribe(
    endpoint: str, topic: bytes, timeout_s: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to a bound PUB socket at `tcp://host:port` or `ipc://path` and subscribe to
    `topic` (a prefix; empty for all)."""
    async with asyncio.timeout(timeout_s):
        if endpoint.startswith("ipc://"):
            reader, writer = await asyncio.open_unix_connection(
                endpoint[len("ipc://") :], limit=READ_LIMIT
            )
        elif endpoint.startswith("tcp://"):
            host, _, port = endpoint[len("tcp://") :].rpartition(":")
            reader, writer = await asyncio.open_connection(
                host.strip("[]"), int(port), limit=READ_LIMIT
            )
        else:
            raise ValueError(f"not a tcp:// or ipc:// endpoint: {endpoint}")
        try:
            writer.write(GREETING)
            greeting = await reader.readexactly(len(GREETING))
            if greeting[0] != 0xFF or greeting[9] != 0x7F or greeting[10] < 3:
                raise Ended("undecodable", "not a ZMTP 3 peer")
            if greeting[12:32].rstrip(b"\0") != b"NULL":
                raise Ended("undecodable", "a security mechanism other than NULL")
            ready = b"\x05READY" + b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"SUB"
            writer.write(_frame(_COMMAND, ready))
            flags, body = await _read_frame(reader, 1 << 16)
            if not flags & _COMMAND or not body.startswith(b"\x05READY"):
                raise Ended("undecodable", "no READY from the peer")
            writer.write(_frame(0, b"\x01" + topic))  # a 3.0 subscription: a message
            await writer.drain()
        except BaseException:
            writer.close()
            raise
    return reader, writer


async def _read_frame(reader: asyncio.StreamReader, max_bytes: int) -> tuple[int, bytes]:
    head = await reader.readexactly(1)
    flags = head[0]
    size = int.from_bytes(await reader.readexactly(8 if flags & _LONG else 1), "big")
    if size > max_bytes:
        raise Ended("oversize", f"a frame of {size} bytes, over {max_bytes}")
    return flags, await reader.readexactly(size)


async def messages(
    reader: asyncio.StreamReader, max_part_bytes: int, max_parts: int
) -> AsyncIterator[list[bytes]]:
    """The messages the publisher sends, each a list of its parts, until the connection ends
    (`Ended`). Commands (a heartbeat's PING) are skipped."""
    parts: list[bytes] = []
    while True:
        try:
            flags, body = await _read_frame(reader, max_part_bytes)
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise Ended("disconnected", f"the publisher closed ({type(exc).__name__})") from None
        if flags & _COMMAND:
            continue
        parts.append(body)
        if len(parts) > max_parts:
            raise Ended("undecodable", f"a message of more than {max_parts} parts")
        if not flags & _MORE:
            yield parts
            parts = []
