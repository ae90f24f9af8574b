"""LoRA adapters: which pools serve which adapter, from the policy and from the replicas.

vLLM lists every loaded adapter in its `/v1/models` as a model card whose `parent` is the base
model it runs on and whose `root` is the adapter's path; base models have no parent
(vllm/entrypoints/openai/models/serving.py, `OpenAIServingModels.show_available_models`; the
card is `ModelCard` in vllm/entrypoints/serve/engine/protocol.py). A request naming an adapter
is sent to a pool serving its base model, counted with that model's tokenizer, and keeps the
adapter's name upstream: rewriting it to the base model would answer without the adapter.

Discovery reads each replica's `/v1/models` on the reconciliation's cadence, bounded in time
(`health.timeout_s`), bytes and names, so a replica cannot make the gateway hold an unbounded
catalog, nor the metrics an unbounded label set.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp
import orjson

from gateway.admit import LivePool

log = logging.getLogger("gateway.fleet.adapters")

MAX_PER_POOL = 256  # adapters discovered per pool beyond the policy's: the rest are ignored
MAX_NAME_CHARS = 256  # a request's `model` is no longer (api/fields.py, MAX_MODEL_CHARS)
MAX_MODELS_BYTES = 1 << 20  # a /v1/models answer this large is not read
PASSIVE_S = 5.0  # with reconciliation off, how often to look whether a reload turned it on
_NONE: frozenset[str] = frozenset()


class Adapters:
    """The adapter catalog: adapter name -> the pools serving it, looked up once per request.

    The policy's lists are fixed; what replicas report replaces a pool's discovered set as a
    whole (`found`). Names that are served models or literal aliases are never adapters: the
    policy's meaning of a name wins over what a replica lists.
    """

    def __init__(
        self,
        bases: Mapping[str, str],
        listed: Mapping[str, tuple[str, ...]],
        reserved: frozenset[str],
        found: Mapping[str, frozenset[str]] | None = None,
    ) -> None:
        self.bases = bases  # pool -> the base model its replicas serve
        self.listed = listed  # pool -> adapters the policy lists for it
        self.reserved = reserved
        self._found = {p: f for p, f in (found or {}).items() if p in bases}
        self._index = self._build()

    def _build(self) -> dict[str, frozenset[str]]:
        index: dict[str, set[str]] = {}
        for pool in self.bases:
            for name in (*self.listed.get(pool, ()), *sorted(self._found.get(pool, _NONE))):
                index.setdefault(name, set()).add(pool)
        return {name: frozenset(pools) for name, pools in index.items()}

    def pools(self, name: str) -> frozenset[str]:
        """The pools serving adapter `name`; empty: it is no known adapter."""
        return self._index.get(name, _NONE)

    def cards(self) -> list[tuple[str, str]]:
        """(adapter, base model) for `/v1/models`, each adapter once, the policy's first."""
        order = {pool: i for i, pool in enumerate(self.bases)}
        return [
            (name, self.bases[min(pools, key=order.__getitem__)])
            for name, pools in self._index.items()
        ]

    def carried(self, bases: Mapping[str, str]) -> dict[str, frozenset[str]]:
        """What was discovered, for a reloaded policy: pools that kept their base model."""
        return {p: f for p, f in self._found.items() if bases.get(p) == self.bases[p]}

    def found(self, pool: str, names: Iterable[str]) -> None:
        """The adapters `pool`'s replicas listed, together; replaces what it had."""
        listed = set(self.listed.get(pool, ()))
        extra = sorted(set(names) - listed - self.reserved)
        if len(extra) > MAX_PER_POOL:
            log.warning("pool %s: its replicas list %d adapters; the first %d are served",
                        pool, len(extra), MAX_PER_POOL)  # fmt: skip
            extra = extra[:MAX_PER_POOL]
        discovered = frozenset(extra)
        if pool in self.bases and self._found.get(pool, _NONE) != discovered:
            self._found[pool] = discovered
            self._index = self._build()


def adapters_in(payload: Any) -> frozenset[str] | None:
    """The adapters a vLLM `/v1/models` answer lists (cards with a `parent`); None if it is not
    such an answer."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return None
    names = set()
    for card in data:
        if not isinstance(card, dict):
            continue
        name, parent = card.get("id"), card.get("parent")
        if isinstance(name, str) and isinstance(parent, str) and 0 < len(name) <= MAX_NAME_CHARS:
            names.add(name)
            if len(names) > MAX_PER_POOL:  # the pool keeps no more than this anyway
                break
    return frozenset(names)


async def list_adapters(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> frozenset[str] | None:
    """What one replica's `/v1/models` lists; None when it could not be read (keep what it had).
    A replica without the endpoint (not vLLM) lists nothing."""
    try:
        async with asyncio.timeout(timeout_s), session.get(url + "/v1/models") as resp:
            if resp.status != 200:
                return _NONE
            raw = bytearray()
            async for chunk in resp.content.iter_any():
                raw += chunk
                if len(raw) > MAX_MODELS_BYTES:
                    return None
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    try:
        return adapters_in(orjson.loads(raw))
    except orjson.JSONDecodeError:
        return None


async def refresh(slots: LivePool, session: aiohttp.ClientSession, catalog: Adapters) -> None:
    """Read every replica's adapters once: each `Replica.adapters` is what it lists, or the
    policy's list while it lists nothing; the pool's catalog entry is their union."""
    listed = frozenset(catalog.listed.get(slots.name, ()))
    replicas = list(slots.replicas)
    timeout_s = slots.spec.health.timeout_s
    answers = await asyncio.gather(*(list_adapters(session, r.url, timeout_s) for r in replicas))
    for replica, names in zip(replicas, answers, strict=True):
        if names is not None or not replica.adapters:
            replica.adapters = names or listed
    catalog.found(slots.name, frozenset().union(*(r.adapters for r in replicas)))


async def follow(
    slots: LivePool, session: aiohttp.ClientSession, catalog: Callable[[], Adapters]
) -> None:
    """Keep the pool's adapters current, every `health.reconcile_interval_s` (0: never);
    `catalog` gives the running policy's, which a reload replaces."""
    while True:
        interval = slots.spec.health.reconcile_interval_s
        if interval:
            try:
                await refresh(slots, session, catalog())
            except Exception:  # never lose discovery to one bad answer
                log.exception("pool %s: reading the replicas' adapters failed", slots.name)
        await asyncio.sleep(interval or PASSIVE_S)
