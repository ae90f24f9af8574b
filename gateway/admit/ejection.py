"""Passive outlier detection: a pool's replicas ejected after failures in a row, or when they
decode far slower than their peers; each ejection lasts longer; a bounded share of the pool at
most is ever out. Active probes (`gateway/fleet/health.py`) decide when one comes back.
Why one was ejected is an `Ejection` (gateway/errors.py, beside the refusals: a broken stream is
held against its replica under the refusal's own name), the `reason` of
`llm_replica_ejections_total`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence

from gateway.admit.replica import Replica
from gateway.config.schema import HealthSpec
from gateway.errors import Ejection

log = logging.getLogger("gateway.admit")  # one logger for the whole stage: operators grep it

TPOT_SMOOTHING = 0.1
# A replica kept in while failing is told at most this often: one whose /health passes while its
# requests fail starts a new spell after every probe.
KEPT_WARNING_EVERY_S = 300.0


def due_for_probe(replica: Replica) -> bool:
    """Ejected long enough to be tried again (half-open)."""
    return replica.ejected_until is not None and time.monotonic() >= replica.ejected_until


def _warn_again(replica: Replica) -> bool:
    now = time.monotonic()
    if replica.kept_warned_at is not None and now - replica.kept_warned_at < KEPT_WARNING_EVERY_S:
        return False
    replica.kept_warned_at = now
    return True


def observe_tpot(replica: Replica, tpot_s: float) -> None:
    replica.tpot = (
        tpot_s if replica.tpot is None else replica.tpot + TPOT_SMOOTHING * (tpot_s - replica.tpot)
    )


class Ejector:
    """Ejects and readmits the replicas of one pool, and counts why it ejected them."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.ejections: Counter[tuple[str, Ejection]] = Counter()  # (replica, why) -> count

    def failed(
        self, replicas: Sequence[Replica], replica: Replica, reason: Ejection, health: HealthSpec
    ) -> None:
        """Count a failure; eject the replica after `consecutive_failures` in a row."""
        replica.failures += 1
        if due_for_probe(replica):  # failed its half-open trial: out again, for longer
            self._eject(replica, reason, health)
        elif replica.failing(health):
            if self._may_eject(replicas, health):
                self._eject(replica, reason, health)
            elif replica.failures == health.consecutive_failures and _warn_again(replica):
                log.warning(
                    "pool %s: replica %s fails (%s, %d in a row) but stays: the pool ejects at"
                    " most max_ejection_percent of its replicas and never its last one",
                    self.pool, replica.url, reason, replica.failures,
                )  # fmt: skip

    def _eject(self, replica: Replica, reason: Ejection, health: HealthSpec) -> None:
        replica.ejections += 1
        ejection_s = health.ejection_s * min(replica.ejections, 10)
        replica.ejected_until = time.monotonic() + ejection_s
        self.ejections[(replica.url, reason)] += 1
        log.warning("pool %s: replica %s ejected for %.0fs (%s, %d failures in a row)",
                    self.pool, replica.url, ejection_s, reason, replica.failures)  # fmt: skip

    def check_speed(self, replicas: Sequence[Replica], health: HealthSpec) -> None:
        """Eject a replica that decodes slower than `slow_ratio` of its peers' median for
        `slow_window_s`: the instance level of the article's circuit breaking."""
        measured = sorted(r.tpot for r in replicas if r.up and r.tpot is not None)
        if len(measured) < 2:
            return
        median = (
            measured[len(measured) // 2]
            if len(measured) % 2
            else ((measured[len(measured) // 2 - 1] + measured[len(measured) // 2]) / 2)
        )
        now = time.monotonic()
        for replica in replicas:
            if not replica.up or replica.tpot is None or replica.tpot * health.slow_ratio <= median:
                replica.slow_since = None
                continue
            replica.slow_since = replica.slow_since or now
            if now - replica.slow_since >= health.slow_window_s:
                replica.slow_since, replica.tpot = None, None  # judged afresh once readmitted
                if self._may_eject(replicas, health):
                    self._eject(replica, Ejection.SLOW, health)

    @staticmethod
    def _may_eject(replicas: Sequence[Replica], health: HealthSpec) -> bool:
        ejected = sum(not r.up for r in replicas)
        share = int(len(replicas) * health.max_ejection_percent / 100)
        return ejected < min(len(replicas) - 1, share)

    def readmit(self, replica: Replica) -> bool:
        """Put an ejected replica back; False if it was in the pool already."""
        if replica.up:
            return False
        replica.ejected_until = None
        replica.failures = 0
        log.info("pool %s: replica %s readmitted", self.pool, replica.url)
        return True
