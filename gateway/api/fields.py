"""A body's fields as the endpoints read them: read as vLLM reads them (integers as pydantic's
lax mode does), and bounded where the gateway echoes or prints them.

Each endpoint's `parse` (gateway/api/) and the parse stage (gateway/request/parse.py) share these;
an error is the client's 400 in its API's shape.
"""

from __future__ import annotations

from typing import Any

from gateway.config.schema import ServerSpec
from gateway.errors import BadRequest

MAX_MODEL_CHARS = 256


def lax_int(body: dict[str, Any], name: str) -> int:
    """A non-negative integer field as pydantic's lax mode reads vLLM's (integral floats and
    numeric strings too); absent or null is 0."""
    value = body.get(name)
    if value is None:
        return 0
    try:
        number = int(value) if isinstance(value, str) else value
    except ValueError:
        number = None
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    if isinstance(number, bool) or not isinstance(number, int):
        raise BadRequest(f"'{name}' must be an integer", param=name, code="invalid_type")
    if number < 0:
        raise BadRequest(f"'{name}' must be >= 0, got {number}", param=name, code="invalid_value")
    return number


def positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer", param=name, code="invalid_type")
    if value < 1:
        raise BadRequest(f"'{name}' must be >= 1, got {value}", param=name, code="invalid_value")
    return value


def text_chars(value: Any) -> int:
    """Characters of every string (keys too) in a JSON value a template may print whole."""
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(map(len, item))
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return total


def check_prompt_chars(chars: int, limits: ServerSpec, param: str) -> None:
    if chars > limits.max_prompt_chars:
        raise BadRequest(
            f"the prompt has {chars} characters, over the {limits.max_prompt_chars} limit",
            param=param,
            code="prompt_too_long",
        )


def check_model(model: Any) -> str:
    """The request's `model`, a non-empty string short enough to echo, or raise 400."""
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", param="model")
    if len(model) > MAX_MODEL_CHARS:  # else a 7 MB name is echoed in the 404 and the access log
        raise BadRequest(
            f"'model' is over {MAX_MODEL_CHARS} characters", param="model", code="model_too_long"
        )
    return model
