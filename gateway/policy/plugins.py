"""Plug-in registry: a policy names a plug-in by `type`; a small class implements it.

Each extension point (`picker`, `output_estimator`) is a one-method protocol defined beside the stage
that calls it. A class registers itself under a type name with `@register(kind, name)` and nests a
pydantic `Params` model, so its parameters are validated at policy load and an unknown type fails
there, listing the known names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError


class NoParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Plugin(Protocol):
    Params: type[BaseModel]

    def __init__(self, params: Any) -> None: ...


P = TypeVar("P", bound=type[Any])
_REGISTRY: dict[str, dict[str, type[Any]]] = {}


class PluginError(ValueError):
    """Raised when a plug-in type is unknown or its parameters are invalid."""


def register(kind: str, name: str) -> Callable[[P], P]:
    def decorate(cls: P) -> P:
        known = _REGISTRY.setdefault(kind, {})
        if name in known:
            raise RuntimeError(f"{kind} plug-in {name!r} registered twice")
        known[name] = cls
        return cls

    return decorate


def create(kind: str, type_name: str, parameters: dict[str, Any]) -> Any:
    known = _REGISTRY.get(kind, {})
    cls = known.get(type_name)
    if cls is None:
        raise PluginError(f"unknown {kind} type {type_name!r}; known: {', '.join(sorted(known))}")
    params_model: type[BaseModel] = getattr(cls, "Params", NoParams)
    try:
        params = params_model.model_validate(parameters)
    except ValidationError as exc:
        detail = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise PluginError(f"{type_name}: {detail}") from None
    return cls(params)
