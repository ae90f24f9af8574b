"""The `picker` extension point: which of a pool's replicas with room takes a request.

The pool calls `picker.pick(replicas, claim)` in one place (`PoolSlots._pick`); a picker only
orders replicas that fit, so the caps stay hard whatever it prefers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gateway.admit.claim import Claim
from gateway.admit.replica import Replica
from gateway.policy.plugins import register


class Picker(Protocol):
    """Chooses among replicas that have room; one instance per policy."""

    def pick(self, replicas: Sequence[Replica], claim: Claim) -> Replica | None: ...


@register("picker", "least-inflight")
class LeastInflightPicker:
    """Fewest requests in flight, then fewest in-flight tokens, then list order."""

    def __init__(self, params: object) -> None:
        pass

    def pick(self, replicas: Sequence[Replica], claim: Claim) -> Replica | None:
        best: Replica | None = None
        best_key = (0, 0)
        for replica in replicas:
            if not replica.fits(claim):
                continue
            # What the replica itself last reported counts too, and its leases across gateways.
            load = max(replica.inflight, replica.observed or 0, replica.shared or 0)
            key = (load, replica.inflight_tokens)
            if best is None or key < best_key:
                best, best_key = replica, key
        return best
