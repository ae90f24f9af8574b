"""A request inside the simulated engine, and the KV blocks it holds.

`Sequence` is what the scheduler (`engine.py`) schedules and what the KV cache (`kv_cache.py`)
allocates blocks to, hashes and frees; `Block` is one position of one kind of layer, which a
sequence references and the cache pools. Both sides need both types, so they live here, below
the two: the engine imports the cache, both import this module, and it imports neither.
"""

from __future__ import annotations

import asyncio
import enum

from loadtest.sim.tokens import PromptIds


class Block:
    """One position of one kind of layer; `key` is its hash while it is cached."""

    __slots__ = ("key", "ref", "weight")

    def __init__(self, weight: int) -> None:
        self.weight = weight
        self.key: int | None = None
        self.ref = 1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Sequence:
    """One request inside the engine; times are simulated seconds."""

    __slots__ = (
        "_waiter",
        "_wake_on_token",
        "arrival",
        "blocks_global",
        "blocks_local",
        "cached_tokens",
        "computed",
        "finish_reason",
        "finished_at",
        "first_token_at",
        "generated",
        "hashes",
        "id",
        "last_token_at",
        "local_start",
        "max_tokens",
        "preemptions",
        "prompt_ids",
        "prompt_tokens",
        "registered",
        "scheduled_at",
        "status",
        "target",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_tokens: int,
        max_tokens: int,
        target: int,
        prompt_ids: PromptIds | None = None,
    ) -> None:
        self.id = seq_id
        self.prompt_tokens = prompt_tokens
        # What the prefix cache hashes; None: a prompt no other request shares.
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.target = target  # output tokens it will produce: max_tokens, or its drawn EOS
        self.arrival = 0.0
        self.computed = 0  # tokens whose KV is in the cache (vLLM's num_computed_tokens)
        self.generated = 0
        self.hashes: list[int] = []  # of its full blocks, computed as needed
        self.blocks_global: list[Block] = []  # one per token block
        self.blocks_local: list[Block | None] = []  # None: left the window, freed
        self.local_start = 0  # blocks_local[:local_start] are all None
        self.registered = 0  # blocks below this one are cached
        self.cached_tokens = 0  # its first admission's prefix-cache hit
        self.status = Status.WAITING
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.finished_at: float | None = None
        self.finish_reason: str | None = None
        self.preemptions = 0
        self._waiter: asyncio.Future[None] | None = None
        self._wake_on_token = False

    @property
    def total(self) -> int:
        """Tokens the model has seen or produced: a recompute must prefill all of them."""
        return self.prompt_tokens + self.generated

    @property
    def units(self) -> int:
        """KV layer-blocks it references (shared blocks count for each sharer)."""
        if not self.blocks_global:
            return 0
        local = len(self.blocks_local) - self.local_start
        return len(self.blocks_global) * self.blocks_global[0].weight + local * (
            self.blocks_local[-1].weight if local else 0  # type: ignore[union-attr]
        )

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    async def wait(self, *, any_token: bool, limit_s: float | None = None) -> None:
        """Until the next token (`any_token`) or only the end, or `limit_s` wall seconds.

        One waiter at a time: the handler that streams this sequence.
        """
        if self.done:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiter, self._wake_on_token = fut, any_token
        timer = loop.call_later(limit_s, _resolve, fut) if limit_s else None
        try:
            await fut
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def notify(self, ended: bool) -> None:
        waiter = self._waiter
        if waiter is not None and (ended or self._wake_on_token):
            _resolve(waiter)
