"""The spare-lease sweep (gateway/admit/leases.py) stops once no replica keeps a spare, however
its spares went: given back, or taken by a request whose slot then went back at once."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gateway.admit.leases import Leases
from gateway.admit.replica import Replica
from gateway.state.base import PoolReplica


class Ledger:
    """What `Leases` calls to give leases back, recorded."""

    gateways, up = 1, True

    def __init__(self) -> None:
        self.given_back: list[tuple[str, str]] = []

    async def unlease(self, replica: PoolReplica, leases: Sequence[tuple[str, str]]) -> None:
        self.given_back += leases


async def test_the_sweep_ends_when_a_request_took_the_last_spare_and_gave_its_slot_back() -> None:
    ledger = Ledger()
    leases = Leases("main", ledger, lambda: None, lambda: None, spare_s=0.02)  # type: ignore[arg-type]
    replica = Replica("http://127.0.0.1:9", 4, None)
    replica.lease_ids["a"] = ""
    leases.release(replica, "a")  # a spare now, the sweep running
    assert replica.reuse("") == "a"  # a request takes it
    leases.others_by_tier[0] = 1  # another gateway waits: its slot goes back as it frees
    leases.release(replica, "a")
    await asyncio.sleep(0.1)
    assert ledger.given_back == [("", "a")]
    assert leases._sweeper is not None and leases._sweeper.done()
    await leases.drain()
