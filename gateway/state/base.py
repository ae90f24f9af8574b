"""The state protocols: what admission shares across requests and, with Redis, across gateways.

- `State`, the tenants' quota windows: every gateway has one (`MemoryState` alone, the Redis
  backends behind `FailoverState` when several share).
- `SlotLedger`, the replicas' slots as leases: only gateways that share replicas have one
  (`FailoverState` again). A gateway alone has none, not an empty one: its pools' own counts
  are every slot there is, and the pool (gateway/admit/pool.py) takes a slot without an await.
- `HolderRecord`, which replica stores each response (the Responses API): again only gateways
  that share, so a conversation's next turn may reach any of them. A gateway alone keeps its
  own record (gateway/request/holders.py) and needs no other.

They are apart because their users are: the quota stage calls `State`, the pool's leases
(gateway/admit/leases.py) call `SlotLedger`, the holder stages `HolderRecord`; one object may
implement all three. A shared store (Redis) is a `Backend`: those calls undecorated, with the
exceptions that mean it is unreachable; `FailoverState` wraps any backend in the failure policy.
Callers name what they keep (a tenant's window, a pool's replica, a response), never a storage
key: the layout is the backend's.

Each call that changes state is one atomic read-modify-write, so the Redis backend is one Lua
script per call; the in-memory one gets atomicity from the event loop (its methods never await).
A state that fails closed raises `StateUnreachable`, a plain exception: state/ knows nothing of
HTTP, and the callers turn it into the client's refusal.

Rate windows are exact sliding windows of `WINDOW_S` seconds, kept as a log of charges: a charge
made at `t` counts during `[t, t + WINDOW_S)`, and a new one is granted only if it fits with
everything still in the window. So no interval of `WINDOW_S` ever holds more granted charges
than the limit — a fixed window lets twice the limit through around its boundary. A charge has
an id so that it can be corrected when the request ends (reserve, then reconcile). The window's
clock belongs to the state (memory: an injectable clock; Redis: the server's `TIME`, one clock for
every gateway), so callers never pass a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol, get_args

WINDOW_S = 60.0

# What the state does right now, for the operator (`llm_state_mode`): `memory`, one gateway's own
# windows; `shared`, a shared backend answers; `local`, it failed and limits are this gateway's
# share; `refusing`, it failed and requests are refused.
Mode = Literal["memory", "shared", "local", "refusing"]
MODES: tuple[Mode, ...] = get_args(Mode)
SERVING: frozenset[Mode] = frozenset(("memory", "shared"))  # the policy's backend answers


class StateUnreachable(Exception):
    """The shared state did not answer and the policy says `on_failure: closed`: refuse rather
    than admit uncounted. A plain exception, as state/ knows nothing of HTTP; the stages that
    call the state turn it into the client's 503 (`gateway.errors.StateUnavailable`), with
    this message and `retry_after_s` (when the state will try the backend again)."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class TenantWindow(NamedTuple):
    """Which window: one of `tenant`'s, named `window` by the caller (e.g. `model:m:tokens`).

    The caller names what it counts; the backend lays out its keys (Redis Cluster wants a
    tenant's windows in one hash slot, so one script may charge them together).
    """

    tenant: str
    window: str


class PoolReplica(NamedTuple):
    """Which replica's slots: `url` as a member of `pool` (one URL in two pools is two ledgers)."""

    pool: str
    url: str


@dataclass(frozen=True, slots=True)
class Limit:
    """Charge `amount` to window `key`, which holds at most `limit` per `WINDOW_S`.

    The limit travels with each call rather than living in the state, so a reloaded policy's
    limits apply to the very next request and windows outlive reloads.
    """

    key: TenantWindow
    amount: int
    limit: int


@dataclass(frozen=True, slots=True)
class Window:
    """One window as the call left it: what the `x-ratelimit-*` headers report."""

    limit: int
    remaining: int  # never below 0, even when corrections pushed usage past the limit
    reset_s: float  # until the window is empty again (its newest charge leaves)


@dataclass(frozen=True, slots=True)
class Reservation:
    """Every limit was charged; `id` names the charges for `adjust`."""

    id: str
    windows: tuple[Window, ...]  # one per limit, in the order given


@dataclass(frozen=True, slots=True)
class WindowFull:
    """Nothing was charged: limit `index` (the first that did not fit) is full."""

    index: int
    retry_after_s: float | None  # when every limit would fit; None: `amount` exceeds the limit
    windows: tuple[Window, ...]


@dataclass(frozen=True, slots=True)
class Correction:
    """Charge `charge_id` in window `key`, `reserved` when made, is really `actual`."""

    key: TenantWindow
    charge_id: str
    reserved: int
    actual: int


@dataclass(frozen=True, slots=True)
class SliceAsk:
    """A slice of window `key` asked of a shared store: at least `need`, up to `need + extra` as
    room allows; `old` is this gateway's previous slice of the window, `(charge id, amount)`,
    rewritten to what it handed out in the same call, so its unused part is room again first."""

    key: TenantWindow
    need: int
    extra: int
    limit: int
    old: tuple[str, int] | None


@dataclass(frozen=True, slots=True)
class SliceGrant:
    """Every slice asked was charged under `id`, `amounts` each (in the order asked), stamped
    `max_age_s` ahead of the store's clock; `windows` as the grant left them."""

    id: str
    amounts: tuple[int, ...]
    windows: tuple[Window, ...]


class Windows(Protocol):
    """The quota windows' calls, as every backend makes them."""

    async def reserve(self, limits: Sequence[Limit]) -> Reservation | WindowFull:
        """Charge every limit, all or none: a request refused for RPM spends no tokens. Raises
        `StateUnreachable` when the backend is down and the policy fails closed."""
        ...

    async def peek(self, limits: Sequence[Limit]) -> tuple[Window, ...]:
        """The windows as they stand, charging nothing (`amount` is ignored): the headers of a
        response refused before its charge (a 400 of a known tenant). Raises
        `StateUnreachable` as `reserve` does."""
        ...

    async def adjust(self, corrections: Sequence[Correction]) -> None:
        """Make each correction, once, when its request ends: one call for all of a request's
        charges (its windows are one tenant's).

        While a charge is in its window it is rewritten in place (it keeps its time). Once it
        has left, only an excess is still owed and is charged now, without a limit check: the
        tokens were spent. A refund of a charge already gone is nothing.
        """
        ...

    async def close(self) -> None:
        """Release connections; the in-memory state has none."""
        ...


class State(Windows, Protocol):
    """The windows as the quota stage holds them: a backend, with what it does right now."""

    def mode(self) -> Mode:
        """What the operator's `llm_state_mode` shows: asked of the state, so the exporter
        names no backend."""
        ...


@dataclass(frozen=True, slots=True)
class SlotClaim:
    """One slot asked of a replica that several gateways share.

    Granted while the replica's leases (of every class) plus the slots the other reserved
    classes keep and do not use stay under `cap`.
    """

    replica: PoolReplica
    workload: str  # the class it is for; "" or a class without a reservation shares the rest
    reserved: tuple[tuple[str, int], ...]  # (class, slots kept for it) of the pool
    cap: int


class Slots(Protocol):
    """The slot ledger's calls, as every shared backend makes them."""

    def lease_id(self) -> str:
        """A new id, unique across gateways: taken before the call so a cancelled call can
        still be undone."""
        ...

    async def lease(self, claim: SlotClaim, lease_id: str) -> tuple[bool, int] | None:
        """(granted, the replica's leases now); None while failing open: count locally.
        Raises `StateUnreachable` while failing closed."""
        ...

    async def renew(
        self,
        replica: PoolReplica,
        held: Sequence[tuple[str, str]],
        released: Sequence[tuple[str, str]] = (),
    ) -> int | None:
        """Extend this gateway's leases (`(class, id)`) on a replica, writing back any that
        expired (their requests still run), and drop `released` ones again (a release that
        raced the renewal); the replica's leases in all, None if unreachable."""
        ...

    async def unlease(self, replica: PoolReplica, leases: Sequence[tuple[str, str]]) -> None:
        """Give slots back (`(class, id)`, one call for all of them); one the backend missed is
        dropped by the replica's next renewal."""
        ...

    async def share_waiting(self, pool: str, waiting: Sequence[int]) -> tuple[int, ...] | None:
        """Report this gateway's waiters in `pool` per tier; all gateways' (recent reports) per
        tier, or None."""
        ...


class SlotLedger(Slots, Protocol):
    """Replica slots shared by several gateways, as leases that live `ttl_s` unless renewed.

    A gateway alone needs no ledger: its own counts (`LivePool`) are every slot there is. With
    several, each slot a gateway holds is also a lease here, so together they never exceed a
    replica's cap, and the slots of a gateway that dies come back when its leases expire.
    Leases are named with their class ("" for none reserved) so reservations can be counted.
    """

    gateways: int  # how many share: while the ledger fails open, each keeps 1/gateways of a cap
    up: bool  # False while failing over


@dataclass(frozen=True, slots=True)
class Holder:
    """Where a stored response lives, and the conversation a request continuing it renders."""

    tenant: str  # "" without tenants
    pool: str
    replica: str
    # The stored turns as chat messages: the inputs and outputs of the conversation so far
    # (gateway/api/responses.py `stored_turns`), the replica's own system messages left out
    turns: tuple[dict[str, Any], ...]
    # Output tokens among them whose text the gateway did not keep (an answer over its
    # bounds): counted as the replica reported them
    unheard: int = 0


class HolderRecord(Protocol):
    """Which replica stores each response, for every gateway that shares: a record lives
    `ttl_s` after it was last written or read. Nothing here refuses: a record that cannot be
    reached is one this gateway does not know (it still knows its own)."""

    async def record(self, response_id: str, holder: Holder) -> None:
        """Keep `holder` as where `response_id` is stored."""
        ...

    async def holder(self, response_id: str) -> Holder | None:
        """Where `response_id` is stored; None if no gateway recorded it (or it expired)."""
        ...

    async def forget(self, response_id: str) -> None:
        """Drop a record whose replica has gone."""
        ...


class Backend(Windows, Slots, HolderRecord, Protocol):
    """A store several gateways share (Redis; build.py's `BACKENDS` names each), as
    `FailoverState` wraps it: every call undecorated, raising one of `failures` when the store
    cannot be reached (down, hung past its time-out, a connection lost). Which exceptions mean
    that, as opposed to a bug, only the backend knows; what the gateway does then (local limits
    or refusals, when to try again) is the policy's, in failover.py, the same for every backend.
    """

    failures: tuple[type[BaseException], ...]
