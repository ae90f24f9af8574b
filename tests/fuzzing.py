"""What the fuzz tests of the API shapes share: arbitrary JSON values, and the check that a body
ends in a count or a 400, never a crash."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from hypothesis import event as tally
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.api import Api
from gateway.context.ctx import Ctx
from gateway.errors import BadRequest
from gateway.request.parse import parse

scalars = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=6)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def counted_or_refused(policy: Any, api: Api, body: dict[str, Any]) -> None:
    """Parse `body` as `api`'s and count it with the policy's `tiny` model: a 400 is tallied
    by the field it names; anything else raised fails the test (a 500 for the client)."""
    ctx = Ctx("fuzz", api, api.path, CIMultiDictProxy(CIMultiDict()), 0.0)
    counter = policy.models["tiny"].counter
    try:
        parse(ctx, "application/json", orjson.dumps(body), policy.spec.server)
        asyncio.run(api.count(ctx.body, counter, 1 << 20, ctx.images))
    except BadRequest as exc:
        tally(f"refused {exc.param or ''}".split("[")[0])
    else:
        tally("counted")
