"""Instance-level circuit breaking: active `/health` probes and the half-open readmission.

Passive outlier detection lives with the slots (`PoolSlots.failed`): every failed request counts.
This task adds what requests cannot see: a replica that is down while nobody sends to it, and the
probe that lets an ejected replica back in once its ejection time is over and it answers again.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from gateway.admit import PoolSlots, Replica

log = logging.getLogger("gateway.health")

PASSIVE_TICK_S = 1.0  # with probes off, how often ejections that ran out are ended


class HealthChecker:
    def __init__(self, slots: PoolSlots, session: aiohttp.ClientSession) -> None:
        self.slots = slots
        self.session = session

    async def run(self) -> None:
        health = self.slots.spec.health
        while True:
            await asyncio.sleep(health.interval_s or PASSIVE_TICK_S)
            health = self.slots.spec.health  # a reload may have changed it
            self.slots.demand.tick(self.slots.spec.max_concurrency)
            if health.interval_s:
                await asyncio.gather(*(self.probe(r) for r in self.slots.replicas))
            else:  # passive only: the next request is the probe
                for replica in self.slots.replicas:
                    if self.slots.due_for_probe(replica):
                        self.slots.readmit(replica)

    async def probe(self, replica: Replica) -> None:
        health = self.slots.spec.health
        try:
            async with (
                asyncio.timeout(health.timeout_s),
                self.session.get(replica.url + health.path) as resp,
            ):
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            ok = False
        if not ok:
            self.slots.failed(replica, "health_check")
        elif replica.up:
            self.slots.succeeded(replica)
        elif self.slots.due_for_probe(replica):
            self.slots.readmit(replica)
