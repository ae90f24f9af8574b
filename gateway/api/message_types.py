"""Which of vLLM's message types a chat message validates as, and what that type refuses.

vLLM 0.32 types `messages` as a union of OpenAI's message types (one per standard role) and its
own `CustomChatCompletionMessageParam`, validated in pydantic's "smart" mode: of the types a
message validates as, the one with the most fields set wins (nested typed dicts count theirs
too), a tie going to OpenAI's. The two disagree on content: OpenAI's types an array as an
`Iterable`, validated lazily, when vLLM's parser first iterates it, against the role's narrow
part types (system, developer and tool messages: text only; user: text, image, audio, file;
assistant: text and refusal), while vLLM's is an eager list of every part type its parser
takes. So whether `[{"type": "input_text", ...}]` is a 400 depends on whether another part or
field tips the count to vLLM's type. This module replays that choice on the request as sent,
so the gateway refuses before counting exactly what vLLM's request model would.

Parts are scored by the members of vLLM's `ChatCompletionContentPartParam` (extra keys are
ignored, so a dict that sets none of a member's optional fields still validates with 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.errors import BadRequest

Check = Callable[[Any], int | None]  # fields a value sets when valid, None when invalid


def _string(value: Any) -> int | None:
    return 0 if isinstance(value, str) else None


def _optional_string(value: Any) -> int | None:
    return 0 if value is None or isinstance(value, str) else None


def _null(value: Any) -> int | None:
    return 0 if value is None else None  # a PIL image never arrives as JSON


def _boolean(value: Any) -> int | None:  # pydantic's lax bool
    if isinstance(value, bool) or (isinstance(value, int | float) and value in (0, 1)):
        return 0
    truthy = ("true", "false", "yes", "no", "on", "off", "t", "f", "y", "n", "1", "0")
    return 0 if isinstance(value, str) and value.lower() in truthy else None


def _literal(*allowed: str) -> Check:
    return lambda value: 0 if isinstance(value, str) and value in allowed else None


def _nullable(check: Check) -> Check:
    return lambda value: 0 if value is None else check(value)


def _typed(required: dict[str, Check], optional: dict[str, Check] | None = None) -> Check:
    """A TypedDict: fields set (its own and nested), or None when the value does not validate."""
    fields = {**required, **(optional or {})}

    def check(value: Any) -> int | None:
        if not isinstance(value, dict) or not required.keys() <= value.keys():
            return None
        count = 0
        for name, field in fields.items():
            if name in value:
                nested = field(value[name])
                if nested is None:
                    return None
                count += 1 + nested
        return count

    return check


def _number(value: Any) -> bool:
    """pydantic's lax `int | float`: numbers and booleans, and strings Python's float reads."""
    if isinstance(value, int | float):
        return True
    if not isinstance(value, str):
        return False
    try:
        float(value)
    except ValueError:
        return False
    return True


def _embeds(value: Any) -> int | None:
    if value is None or isinstance(value, str):
        return 0
    if isinstance(value, dict) and all(
        isinstance(v, str) or (isinstance(v, list) and all(map(_number, v))) for v in value.values()
    ):
        return 0
    return None


_BREAKPOINT = {
    "prompt_cache_breakpoint": _typed(
        {"mode": _literal("explicit")}, {"ttl": _literal("30m", "12h")}
    )
}
_TEXT = _typed({"type": _literal("text"), "text": _string}, _BREAKPOINT)
_IMAGE = _typed(
    {
        "type": _literal("image_url"),
        "image_url": _typed(
            {"url": _string}, {"detail": _literal("auto", "low", "high", "original")}
        ),
    },
    _BREAKPOINT,
)
_INPUT_AUDIO = _typed(
    {
        "type": _literal("input_audio"),
        "input_audio": _typed({"data": _string, "format": _literal("wav", "mp3")}),
    },
    _BREAKPOINT,
)
_FILE = _typed(
    {
        "type": _literal("file"),
        "file": _typed({}, {"file_data": _string, "file_id": _string, "filename": _string}),
    },
    _BREAKPOINT,
)
_REFUSAL = _typed({"type": _literal("refusal"), "refusal": _string})
_UUID = {"uuid": _optional_string}

# vLLM's ChatCompletionContentPartParam, plain strings aside (they set no field): the members
# that need a `type`, by it, and those whose fields are all optional (extra keys ignored).
_TYPED_PARTS: dict[str, Check] = {
    "text": _TEXT,
    "image_url": _IMAGE,
    "input_audio": _INPUT_AUDIO,
    "file": _FILE,
    "audio_url": _typed({"type": _literal("audio_url"), "audio_url": _typed({"url": _string})}),
    "video_url": _typed({"type": _literal("video_url"), "video_url": _typed({"url": _string})}),
    "refusal": _REFUSAL,
    **{
        f"{media}_embeds": _typed(
            {"type": _literal(f"{media}_embeds")}, {f"{media}_embeds": _embeds, **_UUID}
        )
        for media in ("image", "audio", "video")
    },
    "prompt_embeds": _typed({"type": _literal("prompt_embeds"), "data": _string}),
    "thinking": _typed({"type": _literal("thinking"), "thinking": _string}, {"closed": _boolean}),
}
_UNTYPED_PARTS: tuple[Check, ...] = (
    _typed({}, {"image_pil": _null, **_UUID}),
    _typed({}, {"image_url": _optional_string, **_UUID}),
    _typed({}, {"audio_url": _optional_string}),
    _typed({}, {"video_url": _optional_string, **_UUID}),
    _typed({}, {"name": _string, "type": _literal("tool_reference")}),
)
_UNTYPED_KEYS = frozenset({"image_pil", "uuid", "image_url", "audio_url", "video_url", "name"})
# The part types OpenAI's message type for a role checks its content against, lazily.
_OPENAI_PARTS: dict[str, frozenset[str]] = {
    "system": frozenset({"text"}),
    "developer": frozenset({"text"}),
    "tool": frozenset({"text"}),
    "user": frozenset({"text", "image_url", "input_audio", "file"}),
    "assistant": frozenset({"text", "refusal"}),
}


def _vllm_part(part: Any) -> int | None:
    """Fields set by the best member of vLLM's part union `part` validates as, or None."""
    if isinstance(part, str):
        return 0
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    typed = _TYPED_PARTS.get(kind) if isinstance(kind, str) else None
    scores = [] if typed is None or (score := typed(part)) is None else [score]
    if _UNTYPED_KEYS.isdisjoint(part):  # one dict in a thousand is not: skip the members
        scores.append(int(kind == "tool_reference"))
    else:
        scores += [score for member in _UNTYPED_PARTS if (score := member(part)) is not None]
    return max(scores) if scores else None


def _openai_part(part: Any, role: str) -> bool:
    """Whether OpenAI's message type for `role` takes `part` when its content is iterated."""
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str) or kind not in _OPENAI_PARTS[role]:
        return False
    return _TYPED_PARTS[kind](part) is not None


def _valid_part(part: Any) -> bool:
    """Whether `part` validates as some member of vLLM's part union, in a few lookups: the
    members whose fields are all optional, then the one its `type` names."""
    if isinstance(part, str):
        return True
    if not isinstance(part, dict):
        return False
    get = part.get
    uuid_ok = _optional_string(get("uuid")) is not None
    if (
        (uuid_ok and (get("image_pil") is None or _optional_string(get("image_url")) == 0))
        or _optional_string(get("audio_url")) == 0
        or (uuid_ok and _optional_string(get("video_url")) == 0)
        or (
            get("type", "tool_reference") == "tool_reference"
            and ("name" not in part or isinstance(part["name"], str))
        )
    ):
        return True
    kind = get("type")
    typed = _TYPED_PARTS.get(kind) if isinstance(kind, str) else None
    return typed is not None and typed(part) is not None


def _parts(content: Any, beat: int) -> int | None:
    """Fields the parts set, or None if one validates as no part. Once the total is over `beat`
    only validity matters, so each part after is checked, not scored (a cap of parts keeps the
    walk short; scoring is the slow half)."""
    if content is None or isinstance(content, str):
        return 0 if content is not None else None
    if not isinstance(content, list):
        return None
    total = 0
    for part in content:
        if total > beat:
            if not _valid_part(part):
                return None
            continue
        score = _vllm_part(part)
        if score is None:
            return None
        total += score
    return total


_TOOL_CALL = _typed(
    {
        "id": _string,
        "type": _literal("function"),
        "function": _typed({"name": _string, "arguments": _string}),
    }
)


_TOOL = _typed(
    {
        "type": _literal("function"),
        "function": _typed(
            {"name": _string},
            {
                "description": _string,
                "parameters": lambda v: 0 if isinstance(v, dict) else None,
                "strict": _nullable(_boolean),
            },
        ),
    }
)


def _listed(items: Any, check: Check) -> int | None:
    """A list of typed dicts: the fields they set, or None if one does not validate."""
    if items is None:
        return 0
    if not isinstance(items, list):
        return None
    total = 0
    for item in items:
        score = check(item)
        if score is None:
            return None
        total += score
    return total


def _tool_calls(calls: Any) -> int | None:
    return _listed(calls, _TOOL_CALL)


def _vllm_type(message: dict[str, Any], beat: int) -> int | None:
    """Fields set when `message` validates as vLLM's own message type, else None; exact up to
    `beat`, at least `beat + 1` beyond it."""
    score = 0
    for name, value in message.items():
        if name == "content":
            continue  # last: scored only as far as `beat` needs
        if name == "tool_calls":
            nested = _tool_calls(value)
        elif name in ("role", "name"):
            nested = _string(value)
        elif name in ("tool_call_id", "reasoning", "task"):
            nested = _optional_string(value)
        elif name == "tools":
            nested = _listed(value, _TOOL)
        else:
            continue  # an unknown key is ignored
        if nested is None:
            return None
        score += 1 + nested
    if "content" not in message:
        return score
    parts = _parts(message["content"], beat - score - 1)
    return None if parts is None else score + 1 + parts


def _lazy_content(value: Any) -> int | None:
    return 0 if isinstance(value, str | list) else None  # an array is read later, lazily


_NAME: dict[str, Check] = {"name": _string}
# OpenAI's message type for each standard role, its content arrays unread.
_OPENAI_TYPES: dict[str, Check] = {
    role: _typed({"role": _string, "content": _lazy_content}, _NAME)
    for role in ("system", "developer", "user")
} | {
    "tool": _typed({"role": _string, "content": _lazy_content, "tool_call_id": _string}),
    "function": _typed({"role": _string, "content": _optional_string, "name": _string}),
    "assistant": _typed(
        {"role": _string},
        {
            **_NAME,
            "content": _nullable(_lazy_content),
            "refusal": _optional_string,
            "audio": _nullable(_typed({"id": _string})),
            "function_call": _nullable(_typed({"arguments": _string, "name": _string})),
            "tool_calls": lambda v: 0 if isinstance(v, list) else None,  # lazy
        },
    ),
}


def _openai_type(role: str, message: dict[str, Any]) -> int | None:
    """Fields set when `message` validates as OpenAI's type for `role` (its arrays unread)."""
    check = _OPENAI_TYPES.get(role)
    return None if check is None else check(message)


_PLAIN_KEYS = frozenset({"role", "content", "name"})


def check_message_type(message: dict[str, Any], index: int) -> None:
    """Refuse `message` (400) as vLLM's request model would; `reasoning_content` is read as
    vLLM renames it, to `reasoning`."""
    if isinstance(message.get("content"), str) and _PLAIN_KEYS.issuperset(message):
        name = message.get("name", "")
        if isinstance(name, str):
            return  # a role, a string and a name: valid as either type, nothing read lazily
    if "reasoning_content" in message:
        message = dict(message)
        renamed = message.pop("reasoning_content")
        if renamed is not None and message.get("reasoning") is None:
            message["reasoning"] = renamed
    role = message["role"]
    theirs = _openai_type(role, message)
    ours = _vllm_type(message, -1 if theirs is None else theirs)
    param = f"messages[{index}]"
    if ours is None and theirs is None:
        raise BadRequest(
            f"{param} is not a valid {role} message (its content, name, tool_calls or other"
            " fields have the wrong type)",
            param=param,
        )
    if ours is not None and (theirs is None or ours > theirs):
        return
    content = message.get("content")
    for number, part in enumerate(content if isinstance(content, list) else ()):
        if not _openai_part(part, role):
            raise BadRequest(
                f"{param}.content[{number}] is not a valid content part of a {role} message",
                param=f"{param}.content",
            )
    if role == "assistant" and _tool_calls(message.get("tool_calls")) is None:
        raise BadRequest(
            f"{param}.tool_calls must be function calls with a string id, name and arguments",
            param=f"{param}.tool_calls",
        )
