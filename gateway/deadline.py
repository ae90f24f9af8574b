"""A deadline for the current task: `asyncio.timeout_at`'s semantics at about half its cost.

A request that queues runs under one (its wait's), and with shared state each Redis call does,
so the cost is paid per request. (The answer's own deadlines are the forward client's watchdog's:
gateway/upstream.py.)
`asyncio.timeout_at` is an async context manager (two coroutine calls), a state machine and a
reschedulable timer. This is a plain `with` around one timer handle, with the same contract: when the deadline passes, the task is cancelled, and
the `CancelledError` leaving the block becomes a `TimeoutError` unless someone else also
cancelled the task meanwhile (`Task.cancelling`/`uncancel` tell them apart, as in asyncio).
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class Deadline:
    """`with Deadline(loop_time):` raises `TimeoutError` if the block is still running then."""

    __slots__ = ("_cancelling", "_expired", "_handle", "_task", "when")

    def __init__(self, when: float) -> None:
        self.when = when

    def __enter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Deadline must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        self._handle = task.get_loop().call_at(self.when, self._expire)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._handle.cancel()
        if (
            self._expired
            and self._task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc

    def _expire(self) -> None:
        self._task.cancel()
        self._expired = True
