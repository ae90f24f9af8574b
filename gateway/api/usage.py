"""A whole answer's usage, read once the client has the answer: only the accounting needs it.

The forward stage keeps the answer's bytes and where its last `"usage"` key is
(`Ctx.unread_usage`); this decodes that one object, never the whole answer, and hands it to the
endpoint (`Api.read_usage`).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.context.ctx import Ctx

USAGE = b'"usage"'
USAGE_KEY = re.compile(rb'"usage"\s*:\s*')
_USAGE_SPAN = 4096  # a usage object is a few hundred bytes
_DECODER = json.JSONDecoder()


def read_usage(ctx: Ctx) -> None:
    """The output tokens of a whole answer, once it was sent: only the accounting needs them
    (`Accountant.account` calls this, inside its guard)."""
    if ctx.unread_usage is not None:
        data, at = ctx.unread_usage
        ctx.unread_usage = None
        ctx.api.read_usage(ctx, _usage_object(data, at))


def _usage_object(data: bytearray, at: int) -> Any:
    """The value of the last `"usage"` key at or before `at`, decoded alone: parsing a large
    answer whole (logprobs, many choices) would hold the event loop for up to seconds. vLLM
    writes the top-level usage after the choices; a `"usage"` not followed by `:` is a string."""
    while at >= 0:
        key = USAGE_KEY.match(data, at)
        if key is not None:
            span = bytes(data[key.end() : key.end() + _USAGE_SPAN]).decode("utf-8", "replace")
            try:
                return _DECODER.raw_decode(span)[0]
            except (ValueError, RecursionError):  # nested thousands deep: not vLLM's usage
                return None
        at = data.rfind(USAGE, 0, at)
    return None
