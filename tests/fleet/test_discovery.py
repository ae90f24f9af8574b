"""A pool follows its DNS name: replicas join and leave as the records change."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web
from dnslib import QTYPE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSServer

from gateway.fleet.discovery import LOOKUP_S
from loadtest.stub_backend import STATS, create_stub_app
from tests.conftest import eventually

NAME = "gemma3-27b-gen.llm.svc.cluster.local"


class Records(BaseResolver):
    """An authoritative server for one name whose A records the test changes."""

    def __init__(self) -> None:
        self.addresses: list[str] = []
        self.lock = threading.Lock()

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        reply = request.reply()
        qname = str(request.q.qname).rstrip(".")
        if qname == NAME and request.q.qtype == QTYPE.A:
            with self.lock:
                for address in self.addresses:
                    reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=1))
        return reply


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_tcp_port_on(*hosts: str) -> int:
    """A port free on every one of these loopback addresses."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = int(probe.getsockname()[1])
        try:
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no common free port")


@pytest.fixture
def dns_server() -> Iterator[tuple[Records, int]]:
    records, port = Records(), free_udp_port()
    server = DNSServer(records, port=port, address="127.0.0.1")
    server.start_thread()
    yield records, port
    server.stop()


async def test_the_pool_follows_its_dns_records(dns_server, gateway_factory, http) -> None:
    records, dns_port = dns_server
    hosts = ("127.0.0.2", "127.0.0.3")  # all of 127/8 is loopback: two "pods" on one port
    port = free_tcp_port_on(*hosts)
    runners, stats = [], {}
    for host in hosts:
        app = create_stub_app()
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
        stats[host] = app[STATS]
    records.addresses = [hosts[0]]
    policy = {
        "models": {"m": {"tokenizer": "estimate", "max_model_len": 4096}},
        "pools": {"gen": {"model": "m", "max_concurrency": 4,
                          "dns": {"name": f"{NAME}:{port}", "interval_s": 0.05,
                                  "nameservers": [f"127.0.0.1:{dns_port}"]}}},
        "classes": [{"name": "any"}],
        "routes": [{"pool": "gen"}],
    }  # fmt: skip
    try:
        gw = await gateway_factory(policy)
        pool = gw.gateway.slots["gen"]
        assert [r.url for r in pool.replicas] == [f"http://127.0.0.2:{port}"]  # resolved at start

        async def send(n: int) -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            for _ in range(n):
                async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200

        await send(4)
        records.addresses = list(hosts)  # a pod joins
        await eventually(lambda: len(pool.replicas) == 2)
        assert pool.capacity == 8
        records.addresses = [hosts[1]]  # the first one leaves
        await eventually(lambda: [r.url for r in pool.replicas] == [f"http://127.0.0.3:{port}"])
        before = stats[hosts[0]].requests
        await send(4)
        assert stats[hosts[0]].requests == before and stats[hosts[1]].requests >= 4
        async with http.get(f"{gw.metrics_url}/metrics") as resp:
            assert f'replica="http://127.0.0.3:{port}"' in await resp.text()
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_a_failed_lookup_keeps_the_replicas(gateway_factory) -> None:
    records, dns_port = Records(), free_udp_port()
    server = DNSServer(records, port=dns_port, address="127.0.0.1")
    server.start_thread()
    records.addresses = ["127.0.0.2"]
    policy = {
        "models": {"m": {"tokenizer": "estimate", "max_model_len": 4096}},
        "pools": {"gen": {"model": "m", "max_concurrency": 4,
                          "dns": {"name": f"{NAME}:9", "interval_s": 0.05,
                                  "nameservers": [f"127.0.0.1:{dns_port}"]}}},
        "classes": [{"name": "any"}],
        "routes": [{"pool": "gen"}],
    }  # fmt: skip
    gw = await gateway_factory(policy)
    pool = gw.gateway.slots["gen"]
    assert len(pool.replicas) == 1
    server.stop()  # the resolver goes silent: lookups time out
    await asyncio.sleep(LOOKUP_S + 0.5)  # long enough for a lookup to have failed
    assert len(pool.replicas) == 1  # DNS trouble does not empty a pool that serves
