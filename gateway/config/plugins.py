"""Plug-in registry: a policy names a plug-in by `type`; a small class implements it.

Each extension point (`picker`, `scorer`, `output_estimator`) is a small protocol defined beside
the stage that calls it. A class registers itself under a type name with `@register(kind, name)`
and nests a pydantic `Params` model, so its parameters are validated at policy load and an unknown
type fails there, listing the known names.

The registry lives here, below the stages, so that `policy/compile.py` and the CLI can ask it
without knowing which modules hold the plug-ins: a stage's package registers all of its plug-ins
when it is imported (`gateway.pick` its pickers and scorers, `gateway.request.estimate` its estimators).
`config/schema.py` stays below this module and never asks it: a policy's plug-in names are
checked against it when the policy is compiled.
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


def names(kind: str) -> list[str]:
    """The type names registered for `kind`, sorted."""
    return sorted(_REGISTRY.get(kind, {}))


def lookup(kind: str, type_name: str) -> type[Any]:
    """The class registered as `type_name`; an unknown one raises `PluginError` naming the known."""
    cls = _REGISTRY.get(kind, {}).get(type_name)
    if cls is None:
        raise PluginError(f"unknown {kind} type {type_name!r}; known: {', '.join(names(kind))}")
    return cls


def create(kind: str, type_name: str, parameters: dict[str, Any]) -> Any:
    cls = lookup(kind, type_name)
    params_model: type[BaseModel] = getattr(cls, "Params", NoParams)
    try:
        params = params_model.model_validate(parameters)
    except ValidationError as exc:
        detail = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise PluginError(f"{type_name}: {detail}") from None
    return cls(params)
