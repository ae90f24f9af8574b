"""Reconciliation: this gateway's count of a replica's requests against the replica's own.

The health checker reads each replica's vLLM gauges (`EngineGauges`); this decides what they
mean. More requests on the replica than here is normal when gateways share it: the pickers weigh
it. More here than on the replica, twice in a row, is drift: counted, logged, and corrected to
the slots really held, so a lost release can never shrink a replica for good. A counter that
fell means the replica restarted, and whatever a picker learned of its cache is void.
"""

from __future__ import annotations

import logging
from collections import Counter

from gateway.admit.replica import EngineGauges, Replica

log = logging.getLogger("gateway.admit")  # one logger for the stage: operators grep for it


class Reconciler:
    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.drift: Counter[tuple[str, str]] = Counter()  # (replica, kind) -> scrapes

    @staticmethod
    def restarted(replica: Replica, gauges: EngineGauges) -> bool:
        before = replica.gauges
        return (
            before is not None
            and before.prompt_tokens is not None
            and gauges.prompt_tokens is not None
            and gauges.prompt_tokens < before.prompt_tokens
        )

    def observe(self, replica: Replica, gauges: EngineGauges) -> bool:
        """Take the replica's reading; True if its count here was corrected (slots freed)."""
        replica.gauges = gauges
        observed = replica.observed = gauges.running + gauges.waiting
        replica.others = max(0, observed - replica.inflight)
        if replica.inflight <= observed:
            replica.drift_strikes = 0
            return False
        replica.drift_strikes += 1
        self.drift[(replica.url, "gateway_high")] += 1
        if replica.drift_strikes < 2 or replica.inflight <= replica.leases:
            return False
        log.warning("pool %s: replica %s: %d in flight here, %d there, %d held: corrected",
                    self.pool, replica.url, replica.inflight, observed, replica.leases)  # fmt: skip
        replica.inflight = replica.leases
        return True
