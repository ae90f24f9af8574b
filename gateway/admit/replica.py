"""One upstream replica: its caps, what this gateway runs on it, and its health."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

from gateway.admit.claim import Claim
from gateway.config.schema import HealthSpec

if TYPE_CHECKING:
    from gateway.admit.latency import ReplicaLatency


class EngineGauges(NamedTuple):
    """What a replica's /metrics said of its engines (summed over data-parallel ones), and when."""

    running: int
    waiting: int
    kv_usage: float | None  # 0..1: the fullest engine's `vllm:kv_cache_usage_perc`
    prompt_tokens: float | None  # `vllm:prompt_tokens_total`: falls when the replica restarts
    at: float  # time.monotonic() of the reading


class Replica:
    """One upstream vLLM server, what this gateway has running on it, and its health."""

    __slots__ = (
        "adapters",
        "blocked_until",
        "by_class",
        "cap",
        "checked",
        "drift_strikes",
        "ejected_until",
        "ejections",
        "failures",
        "gauges",
        "inflight",
        "inflight_tokens",
        "kept_warned_at",
        "latency",
        "lease_ids",
        "leased_elsewhere",
        "leases",
        "max_concurrency",
        "max_tokens",
        "observed",
        "others",
        "reserve",
        "shared",
        "slow_since",
        "spares",
        "tpot",
        "url",
    )

    def __init__(self, url: str, max_concurrency: int, max_tokens: int | None) -> None:
        self.url = url
        self.max_concurrency = max_concurrency  # the policy's, or its adaptive limit (limiter.py)
        self.cap = max_concurrency  # in force: less while a failing ledger leaves a share
        self.max_tokens = max_tokens
        self.reserve: tuple[tuple[str, int], ...] = ()  # (class, slots kept for it)
        self.inflight = 0
        self.inflight_tokens = 0
        self.by_class: dict[str, int] = {}  # in flight per class, against `reserve`
        self.failures = 0  # consecutive failed requests or probes
        self.checked = False  # a probe or request has answered or failed since it joined
        self.ejections = 0  # times ejected so far: each ejection lasts longer
        self.ejected_until: float | None = None  # None: in the pool
        self.leases = 0  # slots handed out by `slot()` and not yet given back
        self.lease_ids: dict[str, str] = {}  # the ledger's leases held here -> reserved class
        # Of those, the ones no request uses (`leases.py`) -> since when, the oldest first
        self.spares: dict[str, float] = {}
        self.shared: int | None = None  # leases on it across all gateways, as last seen
        self.leased_elsewhere: int | None = None  # of those, the other gateways', at most
        self.blocked_until = 0.0  # the ledger refused a lease: not asked again before this
        self.observed: int | None = None  # the replica's own running + waiting, last scraped
        self.others = 0  # of those, not this gateway's (other gateways', or clients' direct)
        self.drift_strikes = 0  # scrapes in a row that found this gateway's count too high
        self.tpot: float | None = None  # moving average of its streams' time per output token
        self.slow_since: float | None = None  # since when it decodes slower than its peers
        self.kept_warned_at: float | None = None  # last logged as failing but kept in
        self.gauges: EngineGauges | None = None  # its vLLM gauges, when a scorer reads them
        self.adapters: frozenset[str] = frozenset()  # LoRA adapters loaded, as last listed
        self.latency: ReplicaLatency | None = None  # its latency model, in a pool with `slo`

    @property
    def load(self) -> int:
        """Requests on it: this gateway's now plus the others' the replica last reported, or
        its leases across gateways, whichever is more. Not the last report itself: it is a
        second or more old, and requests here have finished and started since."""
        return max(self.inflight + self.others, self.shared or 0)

    @property
    def up(self) -> bool:
        return self.ejected_until is None

    def failing(self, health: HealthSpec) -> bool:
        """In its pool though its last `consecutive_failures` requests or probes failed: the
        pool may eject no more (never its last replica), so requests still go to it."""
        return self.up and self.failures >= health.consecutive_failures

    def fits(self, claim: Claim) -> bool:
        if self.ejected_until is not None or self.inflight >= self.cap:
            return False
        if self.reserve:
            kept = 0  # slots other classes have reserved and do not use
            for workload, slots in self.reserve:
                if workload != claim.workload:
                    kept += max(0, slots - self.by_class.get(workload, 0))
            if self.inflight + kept >= self.cap:
                return False
        if self.blocked_until and time.monotonic() < self.blocked_until:
            return False
        # A request larger than the token cap on its own still runs, alone, on an idle replica.
        return (
            self.max_tokens is None
            or self.inflight == 0
            or self.inflight_tokens + claim.tokens <= self.max_tokens
        )

    def needs_alone(self, claim: Claim) -> bool:
        """`claim` is over the token cap on its own: it runs only once this replica is idle."""
        return self.max_tokens is not None and claim.tokens > self.max_tokens

    def take(self, claim: Claim) -> None:
        """Count a slot handed out here (before the ledger answers, so nothing overbooks)."""
        self.inflight += 1
        self.leases += 1
        self.inflight_tokens += claim.tokens
        by_class = self.by_class
        by_class[claim.workload] = by_class.get(claim.workload, 0) + 1

    def reuse(self, workload: str) -> str | None:
        """A spare lease of class `workload`, the newest (the oldest are the next to go back),
        taken out of the spares; None if there is none."""
        lease_ids = self.lease_ids
        for lease in reversed(self.spares):
            if lease_ids[lease] == workload:
                del self.spares[lease]
                return lease
        return None

    def untake(self, claim: Claim) -> None:
        self.inflight -= 1
        self.leases -= 1
        self.inflight_tokens -= claim.tokens
        by_class = self.by_class
        left = by_class[claim.workload] - 1
        if left:
            by_class[claim.workload] = left
        else:
            del by_class[claim.workload]


class Grant(NamedTuple):
    """A slot held: on which replica, for what, and its lease in the ledger (None: no ledger)."""

    replica: Replica
    claim: Claim
    lease: str | None = None
