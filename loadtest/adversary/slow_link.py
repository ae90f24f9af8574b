"""The gateways' link to `redis-server`, which turns slow for a spell of the run.

A managed Redis under load or across a congested network answers late without going away. Every
reply is held `delay_s` while the spell lasts: under the gateways' call time-out they wait for it;
over it, a call times out after Redis has already done it (a charge, a grant, a lease whose answer
is lost), and the gateway counts locally until it tries Redis again. A Redis that stops closes the
link too, so the outage reads as it would without it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class SlowLink:
    """A loopback TCP relay in front of Redis's `port`; replies are held `delay_s` each."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.delay_s = 0.0
        self._links: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        """The relay's `redis://` URL while it listens; every link closed on the way out."""
        server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            server.close()
            for task in self._links:
                task.cancel()
            await asyncio.gather(*self._links, return_exceptions=True)
            await server.wait_closed()

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(self._link(reader, writer))
        self._links.add(task)
        task.add_done_callback(self._links.discard)

    async def _link(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        try:
            server, to_server = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:  # Redis is stopped: the gateway sees the connection refused, closed
            to_client.close()
            return
        pumps = [
            asyncio.create_task(self._pump(client, to_server, held=False)),
            asyncio.create_task(self._pump(server, to_client, held=True)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            to_client.close()
            to_server.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, held: bool
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(1 << 16):
                if held and self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
