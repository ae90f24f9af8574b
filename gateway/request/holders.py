"""Which replica holds which stored response: the Responses API's affinity.

vLLM keeps the responses it stores in the memory of the replica that made them
(vllm/entrypoints/openai/responses/serving.py `response_store`): a request that continues one
(`previous_response_id`), and `GET /v1/responses/{id}` or its cancel, must reach that replica,
which alone answers them. The gateway names every response it forwards (gateway/api/responses.py
gives vLLM the `request_id` a response is stored under), so it records the holder as the answer
ends and sends what follows there: to its pool (placement, gateway/request/place.py), pinned to its replica (`Claim.replica`), queued
for that replica's room like any request.

The record is bounded (the least recently used go first) and belongs to its tenant: another
tenant's id is as unknown as one never made, and so is any id the gateway could not have made
(it looks no further for it). A response whose replica has left its pool is forgotten when next
asked for, with an error that says so, not a wait for a replica that will not come back.

A continued request's prompt is the whole conversation the replica stores: vLLM 0.32 renders
the stored turns (every earlier input of the chain and the text of every earlier output, system
messages left out) between the request's instructions and its input. So the record keeps, with
each holder, those turns as chat messages (`Holder.turns`): what the request's input stood for,
known when it was parsed, and its output's text, taken from the answer the relay already read
(a stream's terminal event carries the whole response; a whole answer is decoded when it is
small enough not to hold the loop). The count renders them exactly (gateway/request/count.py). In
memory a turn costs its own input and output text: a record shares the earlier turns' messages
with the record of the response they came from. An answer whose text is not kept (over the
bounds in gateway/api/responses.py) is counted by its `output_tokens` instead (`unheard`), in an
empty assistant message that keeps the template's frame around it. Only what a template reads of
a message is kept (`essentials`: no image data, no fields no template prints), and a
conversation over 16 bytes a token of the context is kept as its token count alone.

Gateways that share state through Redis share the record too (`state.HolderRecord`), so a
conversation's turns may reach any of them: each holder is written there before the answer that
made it is sent whole (a stream's last event goes first, by a Redis round trip), and a gateway
that does not know an id asks Redis and keeps the answer. Redis unreachable, a gateway knows the
holders it recorded itself.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING

from gateway.api.responses import Continued, kept_conversation
from gateway.errors import ResponseNotFound
from gateway.state import Holder, HolderRecord
from gateway.tokenizer.chat_template import image_parts

if TYPE_CHECKING:
    from gateway.admit import LivePool
    from gateway.context.ctx import Ctx


# The ids the gateway gives the responses it forwards (gateway/api/responses.py).
_MINTED = re.compile(r"resp_[0-9a-f]{32}")


def _tenant(ctx: Ctx) -> str:
    return ctx.tenant.name if ctx.tenant is not None else ""


class Holders:
    """The bounded record of stored responses' replicas."""

    __slots__ = ("_held", "capacity", "shared")

    def __init__(self, capacity: int, shared: HolderRecord | None = None) -> None:
        self.capacity = capacity
        self.shared = shared  # the other gateways' record too, when they share state
        self._held: OrderedDict[str, Holder] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def _keep(self, response_id: str, holder: Holder) -> None:
        self._held[response_id] = holder
        self._held.move_to_end(response_id)
        while len(self._held) > self.capacity:
            self._held.popitem(last=False)

    async def remember(self, ctx: Ctx) -> None:
        """Record the replica that answered `ctx` whole, if the answer is stored there."""
        if ctx.stores_as is None or ctx.status != 200 or ctx.refusal is not None:
            return
        assert ctx.pool is not None
        turns, unheard = kept_conversation(ctx)
        holder = Holder(_tenant(ctx), ctx.pool.name, ctx.replica, turns, unheard)
        self._keep(ctx.stores_as, holder)
        if self.shared is not None:
            await self.shared.record(ctx.stores_as, holder)

    async def find(self, response_id: str, ctx: Ctx, param: str = "previous_response_id") -> Holder:
        """The holder of the tenant's `response_id`, or a 404 naming `param`."""
        holder = self._held.get(response_id)
        if holder is not None:
            self._held.move_to_end(response_id)
        elif self.shared is not None and _MINTED.fullmatch(response_id):
            holder = await self.shared.holder(response_id)
            if holder is not None:
                self._keep(response_id, holder)
        if holder is None or holder.tenant != _tenant(ctx):
            raise ResponseNotFound(f"Response with id '{response_id}' not found.", param=param)
        return holder

    async def look_up(self, ctx: Ctx) -> None:
        """The stage after parse: the holder of the response the request continues, whose
        stored turns its body carries from here (`Continued`), so its count renders the whole
        conversation as the replica will."""
        if ctx.continues is not None:
            ctx.holder = await self.find(ctx.continues, ctx)
            ctx.body = Continued(ctx.body, ctx.holder.turns)
            ctx.images += image_parts(ctx.holder.turns)  # rendered again, at the image's cost

    async def placed(
        self,
        response_id: str,
        holder: Holder,
        live: Mapping[str, LivePool],
        param: str = "previous_response_id",
    ) -> LivePool:
        """The holder's pool while its replica is still in it; else the record is forgotten,
        and the client told."""
        pool = live.get(holder.pool)
        if pool is None or all(r.url != holder.replica for r in pool.replicas):
            self._held.pop(response_id, None)
            if self.shared is not None:
                await self.shared.forget(response_id)
            raise ResponseNotFound(
                f"Response with id '{response_id}' was stored by a replica that has left the"
                " pool: it is gone.",
                param=param,
            )
        return pool
