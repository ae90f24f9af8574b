"""A JSON body, the shape of every endpoint but a file upload: decoded within the policy's
limits, and sent upstream as the client's own bytes unless the gateway changes a field.

Parsing costs per value, not per byte, so the node and depth limits are checked on the raw
bytes at C speed before anything is built (`server.max_json_nodes`, `max_json_depth`). Upstream,
the client's bytes go as they came when nothing changes, the usual case: a re-encode costs a
copy of the whole body and orjson's time over it, per request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from gateway.context.endpoint import Api
from gateway.errors import BadRequest, UnsupportedMediaType

if TYPE_CHECKING:
    from gateway.config.schema import ServerSpec
    from gateway.context.ctx import Ctx

JSON = "application/json"

_STRUCTURAL = (b",", b":", b"[", b"{")  # an element after the first, a member, a container
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_CURLY_TO_SQUARE = bytes.maketrans(b"{}", b"[]")


def _unescaped(raw: bytes) -> bytes:
    """The body without escape pairs (`\\\\`, then `\\"`, left to right as JSON reads them):
    every quote left opens or closes a string."""
    if b"\\" not in raw:  # a search, far cheaper than two copies
        return raw
    return raw.replace(b"\\\\", b"").replace(b'\\"', b"")


def _outside_strings(unescaped: bytes) -> bytes:
    """The body without its string literals; for any prefix a JSON parser accepts, the quote
    split agrees with its string boundaries."""
    return b"".join(unescaped.split(b'"')[0::2])


def _over(data: bytes, limit: int) -> bool:
    """Whether `data` holds more than `limit` structural characters (bytes.count is C speed;
    commas, the likeliest to settle it, first)."""
    total = 0
    for char in _STRUCTURAL:
        total += data.count(char)
        if total > limit:
            return True
    return False


def _check_nodes(raw: bytes, limit: int) -> bytes | None:
    """Refuse, before anything is built, a body of more than `limit` JSON values.

    Parsing costs per value, not per byte (1.5 million `[]` in 4.5 MB hold the loop for a
    second), so the bound is on structural characters. Counting them in the raw bytes also counts
    commas and colons inside strings; only when that count is over the limit are strings taken
    out for the exact count. Every string but a top-level one comes right after its own `[`, `{`,
    `,` or `:`, so a body with more strings than the limit is refused on its quotes, and the split
    stays small. Returns the
    body outside strings when it was computed, for the depth check.
    """
    if len(raw) <= limit or not _over(raw, limit):
        return None
    too_many = BadRequest(f"body has more than {limit} JSON values", code="json_too_complex")
    unescaped = _unescaped(raw)
    if unescaped.count(b'"') > 2 * (limit + 1):
        raise too_many
    outside = _outside_strings(unescaped)
    if _over(outside, limit):
        raise too_many
    return outside


def _check_depth(raw: bytes, outside: bytes | None, limit: int) -> None:
    """Refuse a body nested deeper than `limit` objects and arrays, at C speed.

    A body with fewer brackets than the limit cannot nest deeper. Otherwise, on its brackets
    outside strings, each pass of `replace("[]", "")` removes exactly the innermost level, so a
    body still non-empty after `limit` passes is deeper; the passes shrink fast and the node
    bound caps the first one.
    """
    if raw.count(b"{") + raw.count(b"[") <= limit:
        return
    if outside is None:
        outside = _outside_strings(_unescaped(raw))
    brackets = outside.translate(_CURLY_TO_SQUARE, _NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return
        brackets = brackets.replace(b"[]", b"")
    if brackets:
        raise BadRequest(f"body is nested deeper than {limit} levels", code="json_too_deep")


def media_type(content_type: str) -> str:
    """The media type of a `Content-Type` value, without its parameters, lower case. The value
    nearly every client sends, bare `application/json`, is answered as it is."""
    if content_type == JSON:
        return JSON
    return content_type.partition(";")[0].strip().lower()


def decode_body(content_type: str, raw: bytes, limits: ServerSpec) -> dict[str, Any]:
    """The body as a JSON object, within the policy's node and depth limits, or raise a 4xx."""
    if media_type(content_type) != JSON:
        raise UnsupportedMediaType(
            f"Content-Type must be application/json, got {content_type or 'none'!r}"
        )
    outside = _check_nodes(raw, limits.max_json_nodes)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object", code="invalid_json")
    _check_depth(raw, outside, limits.max_json_depth)
    return body


def decode_checked(
    content_type: str,
    raw: bytes,
    limits: ServerSpec,
    check: Callable[[dict[str, Any], ServerSpec], dict[str, Any]],
) -> dict[str, Any]:
    """The body decoded (`decode_body`) and checked by `check`, an endpoint's own checks."""
    return check(decode_body(content_type, raw, limits), limits)


class JsonApi(Api):
    """An endpoint whose body is a JSON object: OpenAI's and Anthropic's alike."""

    __slots__ = ()
    content_type = JSON
    # The fields of a small valid request but its `model` (`example`).
    sample: ClassVar[dict[str, Any]]

    def decode(self, raw: bytes, content_type: str, limits: ServerSpec) -> dict[str, Any]:
        return decode_body(content_type, raw, limits)

    def upstream_body(self, ctx: Ctx, changes: dict[str, Any]) -> bytes:
        """The client's bytes, re-encoded only when a field changes. The client's own
        `priority` never goes upstream: on replicas scheduling by priority it would let a
        tenant jump the queue its tier puts it in (the pool's is among `changes`, or none)."""
        body = ctx.body
        if "priority" in body:
            body = {k: v for k, v in body.items() if k != "priority"}
        elif not changes:
            return ctx.raw
        return orjson.dumps({**body, **changes})

    def example(self, model: str) -> tuple[bytes, str]:
        return orjson.dumps({"model": model, **self.sample}), JSON
