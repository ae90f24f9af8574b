"""The `picker` extension point: which of a pool's replicas with room takes a request.

The pool calls `picker.pick(replicas, claim)` in one place (`LivePool._pick`); a picker only
orders replicas that fit, so the caps stay hard whatever it prefers. The pool tells it too when
a slot is held (`granted`) and when the replica answered (`observe`, `LivePool.answered`), so a
picker that learns from where requests went, or from how they came back, needs no other hook.
Admission declares the interface; gateway/pick/ implements it, so pickers import admission's
types and admission imports no picker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gateway.admit.claim import Claim
    from gateway.admit.replica import Replica
    from gateway.context.affinity import Affinity
    from gateway.context.ctx import Ctx
    from gateway.errors import Ejection


class Picker(Protocol):
    """Chooses among replicas that have room."""

    reads_gauges: bool
    """It rates the replicas' scraped gauges: the health checker reads them more often."""

    async def affinity(self, ctx: Ctx) -> Affinity | None:
        """What `pick` will weigh of the request, worked out once, before it queues."""

    def pick(self, replicas: Sequence[Replica], claim: Claim) -> Replica | None: ...

    def cached_share(self, replica: Replica, claim: Claim) -> float:
        """The share of `claim`'s prompt `replica`'s prefix cache is thought to hold, 0..1:
        what a latency model takes off its prefill there (0 for a picker that weighs none)."""

    def granted(self, replica: Replica, claim: Claim) -> None:
        """A slot on `replica` is held for `claim`: a picker that learns, learns here."""

    def observe(self, replica: Replica, claim: Claim, ctx: Ctx, failure: Ejection | None) -> None:
        """`replica` answered the request `claim` was held for (`failure`: how it failed, else
        None): a picker that learns from responses, learns here."""

    def forget(self, url: str) -> None:
        """The replica left, or came back after an ejection: what was learned of it is void."""

    async def close(self) -> None:
        """The pool stopped using it: what it runs in the background stops."""
