"""Instance-level circuit breaking: active `/health` probes and the half-open readmission.

Passive outlier detection lives with the slots (`LivePool.failed`): every request the replica
failed counts (not one that ran out its own `total_s`, nor a client that left).
This task adds what requests cannot see: a replica that is down while nobody sends to it, and the
probe that lets an ejected replica back in once its ejection time is over and it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from gateway.admit import LivePool, Replica
from gateway.errors import Ejection
from gateway.fleet.engine import read_engine

log = logging.getLogger("gateway.fleet.health")

PASSIVE_TICK_S = 1.0  # the longest tick: the demand signal, and ejections that ran out
MAX_METRICS_BYTES = 8 * 1024 * 1024  # a replica's /metrics beyond this is not read at all


class HealthChecker:
    def __init__(self, slots: LivePool, session: aiohttp.ClientSession) -> None:
        self.slots = slots
        self.session = session

    async def run(self) -> None:
        """One loop per pool: the demand signal every tick, probes and reconciliation when due."""
        last_probe = last_reconcile = time.monotonic()
        if self.slots.spec.health.interval_s:  # at once: the first /readyz reports answers
            await asyncio.gather(*(self.probe(r) for r in self.slots.replicas))
        self.slots.probed.set()
        while True:
            health = self.slots.spec.health  # a reload may have changed it
            periods = (health.interval_s, self._reconcile_interval())
            await asyncio.sleep(min([p for p in periods if p] + [PASSIVE_TICK_S]))
            self.slots.demand.tick(self.slots.replica_cap, self.slots.spec.startup_s)
            self.slots.adapt()
            self.slots.check_speed()
            now = time.monotonic()
            reconcile_s = self._reconcile_interval()
            if reconcile_s and now - last_reconcile >= reconcile_s:
                last_reconcile = now
                await asyncio.gather(*(self.reconcile(r) for r in self.slots.replicas if r.up))
            if not health.interval_s:  # passive only: the next request is the probe
                for replica in self.slots.replicas:
                    if self.slots.due_for_probe(replica):
                        self.slots.readmit(replica)
            elif now - last_probe >= health.interval_s:
                last_probe = now
                await asyncio.gather(*(self.probe(r) for r in self.slots.replicas))
            else:  # one DNS or a reload just added: probed now, not an interval later
                await asyncio.gather(*(self.probe(r) for r in self.slots.replicas if not r.checked))

    def _reconcile_interval(self) -> float:
        """Scorers that read the replicas' gauges need them fresher than reconciling does."""
        spec = self.slots.spec
        interval = spec.health.reconcile_interval_s
        if spec.pick is not None and self.slots.picker.reads_gauges:
            return min(interval or spec.pick.metrics_interval_s, spec.pick.metrics_interval_s)
        return interval

    async def reconcile(self, replica: Replica) -> None:
        """Read the replica's own figures from its /metrics (vLLM's names)."""
        try:
            async with (
                asyncio.timeout(self.slots.spec.health.timeout_s),
                self.session.get(replica.url + "/metrics") as resp,
            ):
                if resp.status != 200 or (resp.content_length or 0) > MAX_METRICS_BYTES:
                    return
                body = await resp.content.read(MAX_METRICS_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError, OSError):
            return  # health probes and requests judge reachability; this only counts
        if len(body) > MAX_METRICS_BYTES:
            return
        text = body.decode("utf-8", "replace")
        gauges = await asyncio.to_thread(read_engine, text, self.slots.spec.model)
        if gauges is not None:
            self.slots.reconcile(replica, gauges)

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
            self.slots.failed(replica, Ejection.HEALTH_CHECK)
        elif replica.up:
            self.slots.succeeded(replica)
        elif self.slots.due_for_probe(replica):
            self.slots.readmit(replica)
