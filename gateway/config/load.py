"""Read a policy file and report every problem as `file:line: field.path: message`.

PyYAML is asked for its node tree once to learn the line of every key, so that pydantic's error
locations (`pools.generate-12b.max_concurrency`) can be pointed at a line of the file.
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from gateway.config.schema import PolicySpec

Loc = tuple[str | int, ...]
Checks = Callable[[PolicySpec], list["Problem"]]


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


MAX_DEPTH = 32  # of nested mappings and lists: a policy needs under ten, plug-in parameters a few
MAX_VALUES = 100_000  # scalars, mappings and lists, aliases counted as what they stand for


class _PolicyLoader(yaml.SafeLoader):
    """YAML whose aliases cannot blow up: at most `MAX_VALUES` values and `MAX_DEPTH` levels
    once every alias is expanded, and no alias inside its own anchor.

    Anchors and aliases are ordinary YAML (shared defaults, `<<: *base`), and tools that write
    YAML emit them for any value used twice; but each alias is a reference, so a few lines of
    aliases to aliases make a tree that walking (the line map, validation) visits exponentially
    often, and an alias inside its own anchor makes a cycle that walking never leaves. So each
    node's expanded size and depth are kept as it is composed (aliases cost their target's,
    already known): linear in the file, and refused as a YAML error at its line before
    anything is built.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0
        self.expanded: dict[int, tuple[int, int]] = {}  # id(node) -> (values, depth)
        self.open_anchors: set[str] = set()

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self.open_anchors:
                raise self._refused(f"alias *{event.anchor} is inside its own anchor", event)
            return super().compose_node(parent, index)
        if self.depth >= MAX_DEPTH:
            raise self._refused(f"nested more than {MAX_DEPTH} levels deep", event)
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self.open_anchors.add(anchor)
        self.depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
            self.open_anchors.discard(anchor)
        if isinstance(node, yaml.MappingNode):
            self._unique_keys(node)
        values, depth = self._expanded(node)
        if values > MAX_VALUES:
            raise self._refused(
                f"stands for more than {MAX_VALUES:,} values once its aliases are expanded", event
            )
        if self.depth + depth > MAX_DEPTH:
            raise self._refused(
                f"nested more than {MAX_DEPTH} levels deep once its aliases are expanded", event
            )
        return node

    @staticmethod
    def _unique_keys(node: yaml.MappingNode) -> None:
        """Refuse a key given twice in one mapping. PyYAML keeps the last silently, so an
        operator's edit further down would undo an earlier one with no word, and every error
        would point at the mapping that was thrown away."""
        seen: dict[str, yaml.Node] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            first = seen.setdefault(key.value, key)
            if first is not key:
                raise yaml.composer.ComposerError(
                    f"key {key.value!r} first given", first.start_mark,
                    "given again: a mapping's keys must be unique", key.start_mark,
                )  # fmt: skip

    def _expanded(self, node: yaml.Node | None) -> tuple[int, int]:
        """Values and depth of `node` with its aliases expanded, from its children's."""
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            return 1, 0
        values, depth = 1, 0
        for child in children:
            child_values, child_depth = self.expanded.get(id(child), (1, 0))
            values += child_values
            depth = max(depth, child_depth + 1)
        self.expanded[id(node)] = values, depth
        return values, depth

    @staticmethod
    def _refused(problem: str, event: Any) -> yaml.composer.ComposerError:
        return yaml.composer.ComposerError(None, None, problem, event.start_mark)


def _parse(text: str, name: str) -> tuple[yaml.Node | None, Any]:
    """The node tree (for lines) and the data from one parse, PyYAML's marks naming the file
    rather than `<unicode string>`."""
    loader = _PolicyLoader(text)
    loader.name = name
    try:
        node = loader.get_single_node()
        return node, None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()


def _valid(info: FieldInfo, value: Any) -> Any:
    """`value` as the field's type alone: its model's own validators do not run."""
    assert info.annotation is not None  # pydantic resolves every field's annotation
    return TypeAdapter(info.annotation).validate_python(value)


def _partial(model: type[BaseModel], raw: Any, bad: set[str | int]) -> BaseModel:
    """A broken entry made of the fields that validate on their own; the others are left at
    their defaults or None, so the names it defines still count for references to it."""
    given = raw if isinstance(raw, dict) else {}
    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        key = info.alias or name
        if key in given and key not in bad:
            try:
                fields[name] = _valid(info, given[key])
                continue
            except ValidationError:  # valid only through the model's own validators
                pass
        if info.is_required():
            fields[name] = None
    return model.model_construct(**fields)


_COLLECTIONS = ("models", "pools", "classes", "routes", "tenants")


def _salvage(data: dict[str, Any], errors: Sequence[Loc]) -> PolicySpec | None:
    """What of an invalid policy parsed: every section and entry that validated, broken entries
    as `_partial`s; None when a whole section the references need did not."""
    sections: dict[str, Any] = {}
    for name, info in PolicySpec.model_fields.items():
        where = [loc[1:] for loc in errors if loc[0] == name]
        if name not in data:
            if info.is_required():
                return None
            continue
        if not where:
            sections[name] = _valid(info, data[name])
            continue
        if name not in _COLLECTIONS or any(not loc for loc in where):
            if info.is_required():
                return None
            continue  # its defaults stand in; its own errors say what is wrong
        entry = get_args(info.annotation)[-1]
        raw = data[name]
        keys = raw.keys() if isinstance(raw, dict) else range(len(raw))
        broken = {loc[0] for loc in where}
        parsed = {
            key: _partial(entry, raw[key], {loc[1] for loc in where if loc[0] == key and loc[1:]})
            if key in broken
            else entry.model_validate(raw[key])
            for key in keys
        }
        sections[name] = parsed if isinstance(raw, dict) else list(parsed.values())
    return PolicySpec.model_construct(**sections)


def _dependent(problem: Problem, errors: Sequence[Loc]) -> bool:
    """Whether a problem lies in a field (or entry) that failed: its own error says it, once."""
    return any(problem.loc[: len(loc)] == loc for loc in errors)


def _one(kind: Any) -> Any:
    """A type without `| None` around it (the other member of a two-member union with None)."""
    args = [a for a in get_args(kind) if a is not type(None)]
    return args[0] if get_origin(kind) in (Union, UnionType) and len(args) == 1 else kind


def _field_names(loc: Loc) -> list[str]:
    """The field names of the model at `loc` in a policy, as the file spells them; none where
    the types do not lead to one model. Walked by type: under a mapping or a list, a step is a
    key or an index (a pool named `retry` is a pool, not PoolSpec's `retry` field)."""
    kind: Any = PolicySpec
    for step in loc:
        kind = _one(kind)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            field = next(
                (f for name, f in kind.model_fields.items() if step in (name, f.alias)), None
            )
            if field is None:
                return []
            kind = field.annotation
        elif get_origin(kind) in (dict, list, tuple) and get_args(kind):
            kind = get_args(kind)[-1 if get_origin(kind) is dict else 0]
        else:
            return []
    kind = _one(kind)
    if not (isinstance(kind, type) and issubclass(kind, BaseModel)):
        return []
    return [f.alias or name for name, f in kind.model_fields.items()]


def _with_suggestion(problem: Problem, lines: dict[Loc, int]) -> Problem:
    """An unknown field that is a near miss of a real one says which: a typo is the usual
    cause, and pydantic's own message does not say what the field should have been."""
    loc = _clean(problem.loc, lines)
    if problem.message != "unknown field" or not loc or not isinstance(loc[-1], str):
        return problem
    close = difflib.get_close_matches(loc[-1], _field_names(loc[:-1]), n=1, cutoff=0.75)
    return Problem(problem.loc, f"unknown field; did you mean `{close[0]}`?") if close else problem


def load_spec(path: str | Path, checks: Checks | None = None) -> LoadedSpec:
    """Parse and validate a policy file; raise `PolicyError` listing every problem.

    When fields are invalid, `checks` (the cross-references between sections) run as well over
    what did parse, so that one `check` reports everything rather than one layer at a time.
    """
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError([f"{name}:0: (file): {exc.strerror or exc}"]) from None
    try:
        node, data = _parse(text, name)
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
        problems = [_with_suggestion(p, lines) for p in problems]
        # An entry's fields are its first three steps: deeper ones name a field's own parts.
        failed = [_clean(p.loc, lines)[:3] for p in problems]
        if checks is not None and (partial := _salvage(data, failed)) is not None:
            problems += [p for p in checks(partial) if not _dependent(p, failed)]
        raise PolicyError(format_problems(name, problems, lines)) from None
    return LoadedSpec(name, spec, lines, hashlib.sha256(text.encode()).hexdigest()[:12])
