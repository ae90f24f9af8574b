"""Read a policy file and report every problem as `file:line: field.path: message`.

PyYAML is asked for its node tree once to learn the line of every key, so that pydantic's error
locations (`pools.generate-12b.max_concurrency`) can be pointed at a line of the file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from gateway.policy.schema import PolicySpec

Loc = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    loc: Loc
    message: str


class PolicyError(Exception):
    """Raised with every problem found in a policy file, each naming file, line and field."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


def _line_map(node: yaml.Node, loc: Loc, out: dict[Loc, int]) -> None:
    out.setdefault(loc, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            child = (*loc, str(key.value))
            out[child] = key.start_mark.line + 1
            _line_map(value, child, out)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _line_map(item, (*loc, index), out)


def _message(err: ErrorDetails) -> str:
    ctx = err.get("ctx") or {}
    kind = err["type"]
    simple = {
        "greater_than_equal": "must be >= {ge}",
        "greater_than": "must be > {gt}",
        "less_than_equal": "must be <= {le}",
        "less_than": "must be < {lt}",
        "missing": "required",
        "extra_forbidden": "unknown field",
        "too_short": "must have at least {min_length} item(s)",
        "string_pattern_mismatch": "must match {pattern}",
    }
    if kind in simple:
        return simple[kind].format(**ctx)
    msg = err["msg"]
    return msg.removeprefix("Value error, ")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _clean(loc: Sequence[str | int], lines: dict[Loc, int]) -> Loc:
    """Drop pydantic's union-branch tags (`list[str]`, `function-after[...]`) from a location."""
    out: list[str | int] = []
    for part in loc:
        tag = isinstance(part, str) and ("[" in part or part in _TYPE_TAGS)
        if tag and (*out, part) not in lines:
            continue
        out.append(part)
    return tuple(out)


def format_problems(path: str, problems: Sequence[Problem], lines: dict[Loc, int]) -> list[str]:
    formatted = []
    for problem in problems:
        loc = _clean(problem.loc, lines)
        line = 1
        for end in range(len(loc), -1, -1):
            if loc[:end] in lines:
                line = lines[loc[:end]]
                break
        where = ".".join(str(p) for p in loc) or "(top level)"
        formatted.append(f"{path}:{line}: {where}: {problem.message}")
    return formatted


@dataclass(frozen=True, slots=True)
class LoadedSpec:
    path: str
    spec: PolicySpec
    lines: dict[Loc, int]
    digest: str  # of the file's bytes: `llm_policy_info{hash}` tells which version runs

    def error(self, problems: Sequence[Problem]) -> PolicyError:
        return PolicyError(format_problems(self.path, problems, self.lines))


def load_spec(path: str | Path) -> LoadedSpec:
    """Parse and validate a policy file; raise `PolicyError` listing every problem."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError([f"{name}:0: (file): {exc.strerror or exc}"]) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 0
        raise PolicyError([f"{name}:{line}: (yaml): {exc}"]) from None
    lines: dict[Loc, int] = {}
    if node is not None:
        _line_map(node, (), lines)
    if not isinstance(data, dict):
        raise PolicyError([f"{name}:1: (top level): a policy is a mapping of sections"])
    try:
        spec = PolicySpec.model_validate(data)
    except ValidationError as exc:
        problems = [Problem(tuple(err["loc"]), _message(err)) for err in exc.errors()]
        raise PolicyError(format_problems(name, problems, lines)) from None
    return LoadedSpec(name, spec, lines, hashlib.sha256(text.encode()).hexdigest()[:12])
