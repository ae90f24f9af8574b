"""Predicates compiled once at policy load, shared by class rules and route matches."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping

from gateway.config.schema import Endpoint, Range
from gateway.context.ctx import Ctx

Check = Callable[[Ctx], bool]


def names(patterns: str | list[str]) -> Callable[[str], bool]:
    """A matcher for exact names and `*` globs."""
    listed = [patterns] if isinstance(patterns, str) else patterns
    exact = frozenset(p for p in listed if not any(c in p for c in "*?["))
    globs = [re.compile(fnmatch.translate(p)) for p in listed if p not in exact]
    if not globs:
        return exact.__contains__
    return lambda value: value in exact or any(g.match(value) for g in globs)


def in_range(bound: Range) -> Callable[[float], bool]:
    def check(value: float) -> bool:
        return (
            (bound.gte is None or value >= bound.gte)
            and (bound.gt is None or value > bound.gt)
            and (bound.lte is None or value <= bound.lte)
            and (bound.lt is None or value < bound.lt)
        )

    return check


def request_checks(
    model: str | list[str] | None,
    endpoint: Endpoint | list[Endpoint] | None,
    header: Mapping[str, str] | None,
) -> list[Check]:
    """Checks on what the client sent, known before any token is counted."""
    checks: list[Check] = []
    if model is not None:
        model_ok = names(model)
        checks.append(lambda ctx: model_ok(ctx.requested_model))
    if endpoint is not None:
        endpoints = frozenset([endpoint] if isinstance(endpoint, str) else endpoint)
        checks.append(lambda ctx: ctx.endpoint in endpoints)
    for name, pattern in (header or {}).items():
        value_ok = names(pattern)

        def header_check(
            ctx: Ctx, name: str = name, value_ok: Callable[[str], bool] = value_ok
        ) -> bool:
            value = ctx.headers.get(name)
            return value is not None and value_ok(value)

        checks.append(header_check)
    return checks


def all_of(checks: list[Check]) -> Check:
    if not checks:
        return lambda ctx: True
    if len(checks) == 1:
        return checks[0]
    return lambda ctx: all(check(ctx) for check in checks)
