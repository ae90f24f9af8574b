"""Replica discovery from DNS: a headless Service's A / AAAA records are the pool's replicas.

Resolved every `interval_s`; what changed goes through `LivePool.update`, so a replica that
joins takes requests at once and one that leaves is drained (its in-flight requests finish on
it, no new ones arrive). A failed lookup keeps the replicas the pool has: DNS trouble must not
empty a pool that still serves.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging

import dns.asyncresolver
import dns.exception
import dns.resolver

from gateway.admit import LivePool
from gateway.config.schema import DnsSpec

log = logging.getLogger("gateway.fleet.discovery")

LOOKUP_S = 2.0  # one lookup's deadline: a slow resolver never stalls the loop that calls it


def _resolver(spec: DnsSpec) -> dns.asyncresolver.Resolver:
    if not spec.nameservers:
        return dns.asyncresolver.Resolver()  # resolv.conf, as in a pod
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [
        s.rsplit(":", 1)[0] if s.count(":") == 1 else s for s in spec.nameservers
    ]
    ports = {int(s.rsplit(":", 1)[1]) for s in spec.nameservers if s.count(":") == 1}
    resolver.port = ports.pop() if ports else 53
    return resolver


async def resolve(spec: DnsSpec) -> list[str] | None:
    """The replica URLs the name stands for now, sorted; None when the lookup failed."""
    host, _, port = spec.name.rpartition(":")
    resolver = _resolver(spec)
    addresses: list[str] = []
    for rdtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(host, rdtype, lifetime=LOOKUP_S)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            continue
        except (dns.exception.DNSException, OSError) as exc:
            log.warning("dns %s: lookup failed (%s); keeping the current replicas", spec.name, exc)
            return None
        addresses += [r.to_text() for r in answer]
    urls = []
    for address in addresses:
        ip = ipaddress.ip_address(address)
        where = f"[{ip}]" if ip.version == 6 else str(ip)
        urls.append(f"{spec.scheme}://{where}:{port}")
    return sorted(set(urls))


async def refresh(slots: LivePool) -> None:
    """Resolve once and apply what changed."""
    spec = slots.spec.dns
    if spec is None:
        return
    urls = await resolve(spec)
    if urls is None or urls == [r.url for r in slots.replicas]:
        return
    log.info("pool %s: %s now resolves to %s", slots.name, spec.name, ", ".join(urls) or "nothing")
    slots.update(slots.spec.model_copy(update={"replicas": urls}), slots.picker)


async def follow(slots: LivePool) -> None:
    """Keep the pool's replicas in step with its DNS name while it has one."""
    while slots.spec.dns is not None:
        await asyncio.sleep(slots.spec.dns.interval_s)
        await refresh(slots)
