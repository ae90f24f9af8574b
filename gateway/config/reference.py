"""docs/policy-reference.md, rendered from the policy's pydantic models: every section (model),
and in it every field with its type, default and description.

`python -m gateway.config.reference > docs/policy-reference.md` (`make schema` runs it);
tests/codebase/test_docs.py fails when the file is not what this renders now. It reads only
`gateway.config.schema`, the bottom layer, and its output depends on nothing else: no dates,
no machine, fields in the models' own order.
"""

from __future__ import annotations

import inspect
import json
import re
import types
from collections.abc import Iterator
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from gateway.config.schema import PolicySpec

HEADER = """\
# Policy field reference

<!-- Generated from gateway/config/schema.py by `python -m gateway.config.reference`
     (`make schema`); do not edit by hand: tests/codebase/test_docs.py checks it is current. -->

Every field a policy file may hold, section by section: its type, its default ("required" when it
has none) and what it does. Unknown fields are refused, and so are values outside the bounds given
with the type. Some rules span fields (a pool gives `replicas` or `dns`, lower tiers shed first):
`llm-gateway check` names them. What the sections are for, with an example: [policy.md](policy.md).
"""


def _bounds(metadata: list[Any]) -> list[str]:
    """Constraints pydantic keeps as metadata (annotated_types' `Ge`, `MinLen`, ..., and its own
    `pattern`), each by the attribute that names it."""
    words = (
        ("ge", ">= {}"),
        ("gt", "> {}"),
        ("le", "<= {}"),
        ("lt", "< {}"),
        ("min_length", "length >= {}"),
        ("max_length", "length <= {}"),
        ("pattern", "matching `{}`"),
    )
    return [
        text.format(getattr(item, name))
        for item in metadata
        for name, text in words
        if getattr(item, name, None) is not None
    ]


def _with_bounds(text: str, metadata: list[Any]) -> str:
    bounds = _bounds(metadata)
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _type(tp: Any) -> str:
    """A field's type in words; models link to their section."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *metadata = get_args(tp)
        flat: list[Any] = []
        for item in metadata:
            flat.extend(item.metadata if isinstance(item, FieldInfo) else [item])
        return _with_bounds(_type(base), flat)
    if origin is Literal:
        return " or ".join(f"`{v}`" for v in get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return " or ".join(_type(a) for a in args)
    if origin is list:
        return f"list of {_grouped(get_args(tp)[0])}"
    if origin is dict:
        key, value = get_args(tp)
        return f"map of {_grouped(key)} to {_grouped(value)}"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return f"[{tp.__name__}](#{tp.__name__.lower()})"
    if tp is Any:
        return "any"
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(tp, str(tp))


def _grouped(tp: Any) -> str:
    """A type inside another: in parentheses when it is a choice, so `or` binds as written."""
    text = _type(tp)
    return f"({text})" if " or " in text else text


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, BaseModel):
        try:
            if value == type(value)():
                return "its defaults"
        except ValueError:  # a model with required fields
            pass
        value = value.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`"
    return f"`{json.dumps(value, separators=(', ', ': '))}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _models(tp: Any, path: str) -> Iterator[tuple[type[BaseModel], str]]:
    """The models a type holds, each with the path of its values in a policy file."""
    origin = get_origin(tp)
    if origin is Annotated:
        yield from _models(get_args(tp)[0], path)
    elif origin in (Union, types.UnionType):
        for arg in get_args(tp):
            yield from _models(arg, path)
    elif origin is list:
        yield from _models(get_args(tp)[0], f"{path}[]")
    elif origin is dict:
        yield from _models(get_args(tp)[1], f"{path}.<name>")
    elif isinstance(tp, type) and issubclass(tp, BaseModel):
        yield tp, path


def _sections() -> list[tuple[type[BaseModel], list[str]]]:
    """Every model reachable from `PolicySpec`, breadth first, with the paths it appears at."""
    order: list[type[BaseModel]] = [PolicySpec]
    paths: dict[type[BaseModel], list[str]] = {PolicySpec: [""]}
    for model in order:
        for prefix in list(paths[model]):
            for name, field in model.model_fields.items():
                key = field.alias or name
                path = f"{prefix}.{key}" if prefix else key
                for inner, inner_path in _models(field.annotation, path):
                    if inner not in paths:
                        order.append(inner)
                        paths[inner] = []
                    if inner_path not in paths[inner]:
                        paths[inner].append(inner_path)
    return [(model, paths[model]) for model in order]


def _section(model: type[BaseModel], paths: list[str]) -> str:
    lines = [f"## {model.__name__}", ""]
    if model is PolicySpec:
        lines.append("The top level of the policy file.")
    else:
        lines.append("At " + ", ".join(f"`{p}`" for p in paths) + ".")
    doc = model.__dict__.get("__doc__")
    if doc:
        lines += ["", re.sub(r"\s*\n\s*", " ", inspect.cleandoc(doc)).replace("  ", " ")]
    lines += ["", "| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        kind = _with_bounds(_type(field.annotation), field.metadata)
        row = [f"`{field.alias or name}`", kind, _default(field), field.description or ""]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def render() -> str:
    sections = _sections()
    contents = [f"- [{m.__name__}](#{m.__name__.lower()})" for m, _ in sections]
    body = "\n".join(_section(m, p) for m, p in sections)
    return HEADER + "\n" + "\n".join(contents) + "\n\n" + body


if __name__ == "__main__":
    print(render(), end="")
