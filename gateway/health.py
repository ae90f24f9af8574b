"""Instance-level circuit breaking: active `/health` probes and the half-open readmission.

Passive outlier detection lives with the slots (`PoolSlots.failed`): every failed request counts.
This task adds what requests cannot see: a replica that is down while nobody sends to it, and the
probe that lets an ejected replica back in once its ejection time is over and it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.admit import PoolSlots, Replica

log = logging.getLogger("gateway.health")

PASSIVE_TICK_S = 1.0  # the longest tick: the demand signal, and ejections that ran out
VLLM_COUNTS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def vllm_requests(exposition: str, model: str) -> int | None:
    """Running + waiting requests for `model` in a vLLM /metrics text; None if it has neither."""
    total, found = 0.0, False
    try:
        for family in text_string_to_metric_families(exposition):
            if family.name in VLLM_COUNTS:
                for sample in family.samples:
                    if sample.labels.get("model_name", model) == model:
                        total += sample.value
                        found = True
    except ValueError:  # not a Prometheus exposition
        return None
    return round(total) if found else None


class HealthChecker:
    def __init__(self, slots: PoolSlots, session: aiohttp.ClientSession) -> None:
        self.slots = slots
        self.session = session

    async def run(self) -> None:
        """One loop per pool: the demand signal every tick, probes and reconciliation when due."""
        last_probe = last_reconcile = time.monotonic()
        while True:
            health = self.slots.spec.health  # a reload may have changed it
            periods = (health.interval_s, health.reconcile_interval_s)
            await asyncio.sleep(min([p for p in periods if p] + [PASSIVE_TICK_S]))
            self.slots.demand.tick(self.slots.spec.max_concurrency)
            self.slots.check_speed()
            now = time.monotonic()
            if health.reconcile_interval_s and now - last_reconcile >= health.reconcile_interval_s:
                last_reconcile = now
                await asyncio.gather(*(self.reconcile(r) for r in self.slots.replicas if r.up))
            if not health.interval_s:  # passive only: the next request is the probe
                for replica in self.slots.replicas:
                    if self.slots.due_for_probe(replica):
                        self.slots.readmit(replica)
            elif now - last_probe >= health.interval_s:
                last_probe = now
                await asyncio.gather(*(self.probe(r) for r in self.slots.replicas))

    async def reconcile(self, replica: Replica) -> None:
        """Read the replica's own count of requests from its /metrics (vLLM's names)."""
        try:
            async with (
                asyncio.timeout(self.slots.spec.health.timeout_s),
                self.session.get(replica.url + "/metrics") as resp,
            ):
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
            return  # health probes and requests judge reachability; this only counts
        observed = await asyncio.to_thread(vllm_requests, text, self.slots.spec.model)
        if observed is not None:
            self.slots.reconcile(replica, observed)

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
