"""A tiny authoritative DNS server on loopback: the simulated pool's headless Service.

It answers A queries for each pool's name with the addresses of its replicas that are ready, as
Kubernetes' DNS does for a headless Service (only ready endpoints are published), so the
gateway discovers the pool through its ordinary `dns:` path. Every other question gets an
empty answer (AAAA) or NXDOMAIN (other names). TTL 0: the gateway re-resolves on its own period.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import cast

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The selector loop's UDP transport does not subclass DatagramTransport, but is one.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            query = dns.message.from_wire(data)
        except dns.exception.DNSException:
            return  # not a DNS message: nothing to answer
        assert self.transport is not None
        self.transport.sendto(self.server.answer(query).to_wire(), addr)


class DnsServer:
    """Serves each `name` -> `addresses()` (called at every query) on 127.0.0.1, a free UDP
    port."""

    def __init__(self, zones: Mapping[str, Callable[[], list[str]]]) -> None:
        self.zones = {dns.name.from_text(name): addresses for name, addresses in zones.items()}
        self.port = 0
        self._transport: asyncio.DatagramTransport | None = None

    def answer(self, query: dns.message.Message) -> dns.message.Message:
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        if not query.question:
            return response
        question = query.question[0]
        zone = self.zones.get(question.name)
        if zone is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A and (addresses := zone()):
            response.answer.append(
                dns.rrset.from_text_list(
                    question.name, 0, dns.rdataclass.IN, dns.rdatatype.A, addresses
                )
            )
        return response

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Protocol(self), local_addr=("127.0.0.1", 0)
        )
        self._transport = transport
        self.port = transport.get_extra_info("sockname")[1]

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
