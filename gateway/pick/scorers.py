"""Scorers: each rates the replicas a request may go to, 0 (worst) to 1 (best).

A scorer is a small class registered under the name a pool's `pick.scorers` gives it
(`@register("scorer", name)`), with its parameters in a nested pydantic `Params`; its module is
imported by `gateway/pick/__init__.py`, so the name resolves wherever a policy is compiled. The
picker adds the scores up by weight; a scorer never decides alone and never sees a replica
without room.

A scorer sees a request at four points, each a method with a no-op default here, so a scorer
overrides only the ones it needs and the weighted picker calls only those:
`prepare` once per request before it queues (what the scorer will weigh of it, kept in the
request's `Affinity` under the field the scorer names in `part`; awaited if `awaits`); `score` at each pick;
`granted` once a slot is held (prefix and session learn there where the request went);
`observe` when the replica has answered (a scorer that learns from responses learns there).
`follow` sees the pool's replicas at each pick and `forget` a replica that left, restarted or
was ejected.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

from gateway.config.plugins import register
from gateway.pick.prefix_index import PrefixIndex
from gateway.pick.prompt import MAX_SESSION_CHARS, chain, prompt_text

if TYPE_CHECKING:
    from gateway.admit import Claim, Replica
    from gateway.admit.replica import EngineGauges
    from gateway.context.ctx import Ctx
    from gateway.errors import Ejection


class _Params(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Scorer:
    Params: type[BaseModel] = _Params
    part: ClassVar[str | None] = None  # the `Affinity` field `prepare` fills; None: it has none
    reads_gauges = False  # rates the replicas' scraped gauges: they are read more often for it
    wants_token_ids = False  # looks up the prompt's token ids: the pool needs a real tokenizer

    def __init__(self, params: BaseModel) -> None:
        pass

    awaits = False  # `prepare` is a coroutine: set by a scorer that must wait (for a tokenizer)

    def prepare(self, ctx: Ctx) -> Any:
        """What `score` will weigh of the request, worked out once, before it queues: the value
        of the `Affinity` field named by `part`. Called only when `part` is set; a plain call
        unless `awaits`, so a scorer with nothing to wait for costs no coroutine a request."""

    def score(self, replicas: Sequence[Replica], claim: Claim, now: float) -> list[float]:
        raise NotImplementedError

    def follow(self, replicas: Sequence[Replica]) -> None:
        """The pool's replicas at a pick, busy ones too (a scorer fed by them follows them)."""

    def granted(self, replica: Replica, claim: Claim) -> None:
        """A slot on `replica` is held for `claim`."""

    def observe(self, replica: Replica, claim: Claim, ctx: Ctx, failure: Ejection | None) -> None:
        """`replica` answered `claim`'s request (`failure`: how it failed, else None)."""

    def forget(self, url: str) -> None:
        """The replica left, restarted or was ejected: what was learned about it is void."""

    async def close(self) -> None:
        """The picker stopped using it: what it runs in the background stops."""


def _spread(values: Sequence[float]) -> list[float]:
    """Lower is better, scaled to the candidates: the least 1, the most 0 (all equal: 1)."""
    low, high = min(values), max(values)
    if high == low:
        return [1.0] * len(values)
    return [(high - v) / (high - low) for v in values]


class PrefixParams(_Params):
    block_chars: PositiveInt = Field(
        256,
        description=(
            "Characters of prompt per block (about 64 tokens); a prompt's last partial block"
            " is never counted."
        ),
    )
    max_blocks: PositiveInt = Field(
        1024, description="Blocks hashed per request: the prompt's first 256k characters."
    )
    capacity_blocks: PositiveInt = Field(
        65_536,
        description=(
            "Blocks remembered per replica (about 100 bytes each), the oldest forgotten first."
            " Size it to what a replica's KV cache holds: its cache in tokens x 4 / block_chars."
        ),
    )


@register("scorer", "prefix")
class PrefixScorer(Scorer):
    """The share of the request's leading blocks this gateway last sent to each replica."""

    Params = PrefixParams
    part = "blocks"

    def __init__(self, params: PrefixParams) -> None:
        self.block_chars = params.block_chars
        self.max_blocks = params.max_blocks
        self.index = PrefixIndex(params.capacity_blocks)
        self.blocks_sent = 0  # blocks of the requests granted, and of those, held where they went
        self.blocks_matched = 0

    def prepare(self, ctx: Ctx) -> tuple[int, ...]:
        prompt = prompt_text(ctx.body)
        if prompt is None:
            return ()
        # vLLM keys an adapter's and a salted request's blocks apart from the base model's.
        seed = (ctx.adapter, ctx.body.get("cache_salt"))
        return chain(seed, prompt, self.block_chars, self.max_blocks)

    def score(self, replicas: Sequence[Replica], claim: Claim, now: float) -> list[float]:
        blocks = claim.affinity.blocks if claim.affinity is not None else ()
        if not blocks:
            return [0.0] * len(replicas)
        matched = self.index.matched
        return [matched(r.url, blocks) / len(blocks) for r in replicas]

    def granted(self, replica: Replica, claim: Claim) -> None:
        if claim.affinity is not None and claim.affinity.blocks:
            blocks = claim.affinity.blocks
            self.blocks_sent += len(blocks)
            self.blocks_matched += self.index.matched(replica.url, blocks)
            self.index.record(replica.url, blocks)

    def forget(self, url: str) -> None:
        self.index.forget(url)


class SessionParams(_Params):
    header: str = Field(
        "x-session-id",
        description="Request header naming the session; without it, the OpenAI `user` field.",
    )
    max_sessions: PositiveInt = Field(65_536, description="Sessions remembered, oldest forgotten.")


@register("scorer", "session")
class SessionScorer(Scorer):
    """1 for the replica the session's previous request went to: its conversation is cached
    there, even where the prompt changed too early for the prefix blocks to show it."""

    Params = SessionParams
    part = "session"

    def __init__(self, params: SessionParams) -> None:
        self.header = params.header
        self.max_sessions = params.max_sessions
        self._last: OrderedDict[str, str] = OrderedDict()

    def prepare(self, ctx: Ctx) -> str | None:
        name = ctx.headers.get(self.header)
        if name is None:
            user = ctx.body.get("user")
            name = user if isinstance(user, str) and user else None
        if name is None:
            return None
        # Keyed by tenant: one tenant naming another's session steers nothing of theirs.
        tenant = ctx.tenant.name if ctx.tenant is not None else ""
        return f"{tenant}\x1f{name[:MAX_SESSION_CHARS]}"

    def score(self, replicas: Sequence[Replica], claim: Claim, now: float) -> list[float]:
        session = claim.affinity.session if claim.affinity is not None else None
        last = self._last.get(session) if session is not None else None
        return [1.0 if r.url == last else 0.0 for r in replicas]

    def granted(self, replica: Replica, claim: Claim) -> None:
        session = claim.affinity.session if claim.affinity is not None else None
        if session is None:
            return
        self._last[session] = replica.url
        self._last.move_to_end(session)
        if len(self._last) > self.max_sessions:
            self._last.popitem(last=False)

    def forget(self, url: str) -> None:
        for session in [s for s, u in self._last.items() if u == url]:
            del self._last[session]


class GaugeParams(_Params):
    max_age_s: PositiveFloat = Field(
        5.0,
        description=(
            "A scraped gauge counts fully when fresh and less as it ages, not at all after this:"
            " the replica's state has moved on since."
        ),
    )


class _GaugeScorer(Scorer):
    Params = GaugeParams
    reads_gauges = True

    def __init__(self, params: GaugeParams) -> None:
        self.max_age_s = params.max_age_s

    def freshness(self, gauges: EngineGauges, now: float) -> float:
        return max(0.0, 1.0 - (now - gauges.at) / self.max_age_s)


@register("scorer", "queue")
class QueueScorer(_GaugeScorer):
    """Fewest requests on the replica: running and waiting there as last scraped
    (`vllm:num_requests_running` + `vllm:num_requests_waiting`, which count other gateways' too),
    or this gateway's own in flight when that is more, the scrape weighed by its age."""

    def score(self, replicas: Sequence[Replica], claim: Claim, now: float) -> list[float]:
        loads = []
        for r in replicas:
            load = float(r.inflight)
            gauges = r.gauges
            if gauges is not None:
                fresh = self.freshness(gauges, now)
                load = max(load, fresh * (gauges.running + gauges.waiting) + (1 - fresh) * load)
            loads.append(load)
        return _spread(loads)


@register("scorer", "kv_cache")
class KvCacheScorer(_GaugeScorer):
    """Most free KV cache (`vllm:kv_cache_usage_perc`): a replica near full preempts, which
    costs every request on it a recompute. A stale reading drifts to the neutral 0.5."""

    def score(self, replicas: Sequence[Replica], claim: Claim, now: float) -> list[float]:
        scores = []
        for r in replicas:
            gauges = r.gauges
            if gauges is None or gauges.kv_usage is None:
                scores.append(0.5)
                continue
            fresh = self.freshness(gauges, now)
            scores.append(fresh * (1.0 - gauges.kv_usage) + (1 - fresh) * 0.5)
        return scores


def spread_limit(share: float, max_concurrency: int) -> int:
    """The most requests a replica may run above the least loaded one and still be chosen."""
    return max(1, math.ceil(share * max_concurrency))
