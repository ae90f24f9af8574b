"""The layering the code is built on, checked: which parts of the gateway may import which.

- The policy's schema and loading are the bottom layer: every part reads them, so they import
  no stage (else a stage's import reaches back into the policy while it loads).
- Stages are the request path's steps. They import neither the process around them (runtime,
  pipeline) nor the HTTP server: a stage is testable with a `Ctx` and a policy, nothing running.
- Shared state speaks its own protocol: no HTTP errors, no aiohttp, no prometheus-client. What a
  refusal looks like to a client, and what is exported, are decided above it.

Imports are read from the source (`ast`), the type-only ones (`if TYPE_CHECKING:`) included for
the direct rules, and followed transitively through the runtime ones: a stage that reaches the
server through a helper module breaks its rule as surely as one importing it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gateway"

POLICY_BOTTOM = ("gateway.policy.schema", "gateway.policy.load")
STAGES = (
    "gateway.authenticate",
    "gateway.parse",
    "gateway.route",
    "gateway.tokenize",
    "gateway.estimate",
    "gateway.classify",
    "gateway.spill",
    "gateway.quota",
    "gateway.admit",
    "gateway.forward",
    "gateway.account",
)
ABOVE_STAGES = ("gateway.runtime", "gateway.pipeline", "gateway.server", "gateway.cli")
STATE = "gateway.state"
NOT_IN_STATE = ("gateway.errors", "aiohttp", "prometheus_client", "gateway.observability")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, with_type_only: bool) -> Iterator[str]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            if with_type_only:
                yield from _imports(node, with_type_only)
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and not node.level:
            yield node.module
            # `from gateway.replicas import adapters` imports the module `adapters`
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        else:
            yield from _imports(node, with_type_only)


@cache
def imports(module: str, with_type_only: bool) -> frozenset[str]:
    known = _modules()
    tree = ast.parse(known[module].read_text())
    found = set()
    for name in _imports(tree, with_type_only):
        top = name.split(".")[0]
        if top != "gateway":
            found.add(top)
        elif name in known:
            found.add(name)
    return frozenset(found)


def reachable(module: str) -> dict[str, str]:
    """Every module `module` imports when it is imported, each with the chain that reaches it."""
    chains = {module: module}
    todo = [module]
    while todo:
        current = todo.pop()
        for name in imports(current, with_type_only=False):
            if name not in chains:
                chains[name] = f"{chains[current]} -> {name}"
                if name in _modules():
                    todo.append(name)
    return chains


def _within(name: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _breaks(modules: list[str], forbidden: tuple[str, ...]) -> list[str]:
    broken = []
    for module in modules:
        direct = [n for n in imports(module, with_type_only=True) if _within(n, forbidden)]
        broken += [f"{module} imports {name}" for name in direct]
        chains = reachable(module)
        broken += [chains[n] for n in chains if _within(n, forbidden) and n not in direct]
    return sorted(set(broken))


def test_the_modules_are_found() -> None:
    modules = _modules()
    assert set(POLICY_BOTTOM) | {"gateway.pipeline", "gateway.runtime"} <= modules.keys()
    for stage in STAGES:
        assert any(_within(m, stage) for m in modules), stage


def test_policy_schema_and_loading_import_no_stage() -> None:
    stages_and_above = (*STAGES, *ABOVE_STAGES, "gateway.policy.compile")
    assert _breaks(list(POLICY_BOTTOM), stages_and_above) == []


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_imports_neither_the_runtime_nor_the_server(stage: str) -> None:
    modules = [m for m in _modules() if _within(m, stage)]
    assert _breaks(modules, ABOVE_STAGES) == []


def test_state_imports_no_http_errors_and_no_prometheus() -> None:
    modules = [m for m in _modules() if _within(m, STATE)]
    assert _breaks(modules, NOT_IN_STATE) == []


def test_a_rule_broken_is_seen() -> None:
    """The checker itself: a module that reaches the server through another is caught."""
    chains = reachable("gateway.runtime")
    assert "gateway.policy.compile" in chains
    assert _breaks(["gateway.runtime"], ("gateway.policy.schema",)) != []
