"""What gateway/state/ promises whichever store runs: the failure policy over any backend, the
backends by the names the schema allows, the mode the exporter reads.

The backend failed over here is not Redis but the in-memory one, `MemoryState`, made unreachable
the way any store is: its calls raise an exception type that it declares as meaning
"unreachable" (its clock raises while `down`, and every call reads the clock first). Redis behind
the same policy is tests/state/test_redis_state.py's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal, get_args

import pytest
from prometheus_client import CollectorRegistry

from gateway.config.schema import StateSpec
from gateway.exporter.backend import BackendCollector
from gateway.state import Correction, Limit, MemoryState, Reservation, State, TenantWindow
from gateway.state.base import StateUnreachable
from gateway.state.build import BACKENDS, build_state
from gateway.state.failover import FailoverState
from tests.request.test_quotas import Clock

TOKENS = TenantWindow("acme", "tokens")


class Unreachable(Exception):
    """What this store raises when it does not answer."""


class FlakyClock(Clock):
    """The store's clock; while `down`, reading it raises `fault` (by default `Unreachable`)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.fault: type[BaseException] = Unreachable

    def __call__(self) -> float:
        if self.down:
            raise self.fault("the store did not answer")
        return self.now


class FlakyMemory(MemoryState):
    """The in-memory windows as a shared backend that can be unreachable."""

    failures = (Unreachable,)


def failover(
    on_failure: Literal["open", "closed"], gateways: int = 4
) -> tuple[FailoverState, FlakyClock]:
    clock = FlakyClock()
    state = FailoverState(
        FlakyMemory(clock),  # type: ignore[arg-type]  # windows only: no slot or holder calls
        on_failure=on_failure,
        gateways=gateways,
        retry_s=1.0,
        monotonic=lambda: clock.now,  # the policy's clock never fails
    )
    return state, clock


async def test_a_backend_that_fails_open_counts_locally_then_shares_again() -> None:
    state, clock = failover("open")
    first = await state.reserve([Limit(TOKENS, 10, 100)])
    assert isinstance(first, Reservation) and first.windows[0].remaining == 90
    assert state.mode() == "shared"

    clock.down = True
    local = await state.reserve([Limit(TOKENS, 10, 100)])
    assert isinstance(local, Reservation) and local.id.startswith("local:")
    assert local.windows[0].limit == 25  # 1/4 of the limit: four gateways count alone
    assert (state.up, state.mode()) == (False, "local")
    # Each correction goes where its charge was made: the local one here, the shared one is
    # lost (logged) while the backend is down.
    await state.adjust([Correction(TOKENS, local.id, 10, 5), Correction(TOKENS, first.id, 10, 5)])
    assert (await state.local.peek([Limit(TOKENS, 0, 25)]))[0].remaining == 20

    clock.down = False  # back, but not asked again before `retry_s`
    again = await state.reserve([Limit(TOKENS, 10, 100)])
    assert isinstance(again, Reservation) and again.id.startswith("local:")
    clock.now += 1.0
    shared = await state.reserve([Limit(TOKENS, 10, 100)])
    assert isinstance(shared, Reservation) and not shared.id.startswith("local:")
    assert shared.windows[0].remaining == 80  # its charges, the lost correction's included
    assert (state.up, state.mode()) == (True, "shared")


async def test_a_backend_that_fails_closed_refuses_until_it_answers() -> None:
    state, clock = failover("closed")
    clock.down = True
    with pytest.raises(StateUnreachable) as refused:
        await state.reserve([Limit(TOKENS, 10, 100)])
    assert refused.value.retry_after_s == 1.0
    with pytest.raises(StateUnreachable):
        await state.peek([Limit(TOKENS, 0, 100)])
    assert state.mode() == "refusing"
    clock.down = False
    clock.now += 1.0
    assert isinstance(await state.reserve([Limit(TOKENS, 10, 100)]), Reservation)
    assert state.mode() == "shared"


@pytest.mark.parametrize("fault", [ConnectionError, TimeoutError, ValueError])
async def test_only_the_failures_a_backend_declares_fail_over(fault: type[Exception]) -> None:
    """An exception the backend does not declare is a bug, raised as one, even the kinds that
    mean "unreachable" for another backend (Redis: `OSError`, `TimeoutError`)."""
    state, clock = failover("open")
    clock.down, clock.fault = True, fault
    with pytest.raises(fault):
        await state.reserve([Limit(TOKENS, 10, 100)])
    assert (state.up, state.mode()) == (True, "shared")


def scrape(state: State) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(BackendCollector(lambda: SimpleNamespace(state=state)))  # type: ignore[arg-type, return-value]
    return {
        f"{s.name}{s.labels.get('mode', '')}": s.value
        for family in registry.collect()
        for s in family.samples
    }


async def test_the_exporter_shows_the_mode_any_state_reports() -> None:
    alone = scrape(MemoryState())
    assert alone["llm_state_backend_up"] == 1 and alone["llm_state_modememory"] == 1
    state, clock = failover("open")
    clock.down = True
    await state.reserve([Limit(TOKENS, 10, 100)])
    seen = scrape(state)
    assert seen["llm_state_backend_up"] == 0
    assert {k: v for k, v in seen.items() if k.startswith("llm_state_mode") and v} == {
        "llm_state_modelocal": 1
    }


async def test_every_backend_the_schema_allows_is_built() -> None:
    """The schema's names and the registry's are one list: a backend registered and not
    selectable, or selectable and not registered, fails here."""
    names = get_args(StateSpec.model_fields["backend"].annotation)
    assert set(names) == {"memory", *BACKENDS}
    for name in names:
        state, ledger, record = build_state(StateSpec(backend=name))
        try:
            alone = name == "memory"
            assert state.mode() == ("memory" if alone else "shared")
            assert (ledger is None, record is None) == (alone, alone)
        finally:
            await state.close()
