"""`Deadline` keeps `asyncio.timeout_at`'s contract: the tests run each case against both."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from gateway.deadline import Deadline


@contextlib.asynccontextmanager
async def ours(when: float) -> Any:
    with Deadline(when) as scope:
        yield scope


SCOPES: dict[str, Callable[[float], Any]] = {"Deadline": ours, "asyncio": asyncio.timeout_at}


def soon(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


@pytest.fixture(params=sorted(SCOPES))
def scope(request: pytest.FixtureRequest) -> Callable[[float], Any]:
    return SCOPES[request.param]


async def test_a_block_past_its_deadline_raises_timeout_error(scope: Any) -> None:
    with pytest.raises(TimeoutError):
        async with scope(soon(0.01)):
            await asyncio.sleep(10)
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    await asyncio.sleep(0)  # and no cancellation is left pending on the task


async def test_a_block_that_ends_in_time_is_untouched(scope: Any) -> None:
    async with scope(soon(10)):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.02)  # the timer is gone: nothing cancels the task later


async def test_a_deadline_already_past_fires_at_the_first_await(scope: Any) -> None:
    with pytest.raises(TimeoutError):
        async with scope(soon(-1)):
            await asyncio.sleep(1)


async def test_other_errors_pass_through(scope: Any) -> None:
    with pytest.raises(KeyError):
        async with scope(soon(10)):
            raise KeyError("x")


async def test_an_outside_cancellation_stays_a_cancellation(scope: Any) -> None:
    async def body() -> None:
        async with scope(soon(10)):
            await asyncio.sleep(10)

    task = asyncio.create_task(body())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancellation_racing_the_deadline_is_not_swallowed(scope: Any) -> None:
    """Cancelled by someone else in the very tick the deadline passes: the task must stay
    cancelled (the handler of a client that left must not carry on as if it only timed out)."""

    async def body() -> None:
        when = soon(0.02)
        async with scope(when):  # its timer first, then the other cancel, at the same time
            asyncio.get_running_loop().call_at(when, asyncio.current_task().cancel)  # type: ignore[union-attr]
            await asyncio.sleep(10)

    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.create_task(body()), 1)


async def test_nested_deadlines_each_raise_at_their_own_level(scope: Any) -> None:
    outer_fired = False
    try:
        async with scope(soon(0.02)):
            with pytest.raises(TimeoutError):
                async with scope(soon(0.01)):
                    await asyncio.sleep(10)
            await asyncio.sleep(10)
    except TimeoutError:
        outer_fired = True
    assert outer_fired


def test_a_deadline_needs_a_task() -> None:
    with pytest.raises(RuntimeError):
        Deadline(0).__enter__()
