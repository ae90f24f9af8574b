"""The layering the code is built on, checked: which parts of the gateway may import which.

Every package (and top-level module) of `gateway` sits in one layer of `LAYERS`, listed bottom
first, and imports only from the layers below it, type-only imports (`if TYPE_CHECKING:`)
included: so there is no import circle between packages, and a newcomer reads the list to know
what may depend on what.

- The configured policy (`config`) is the bottom: every part reads it.
- `context` is the request's record and the types it names: endpoints, pickers, admission and the
  stages all meet there instead of in each other.
- The stages (`request`) import neither the process around them (runtime, pipeline) nor the HTTP
  server: a stage is testable with a `Ctx` and a policy, nothing running. The compiled `policy`
  sits above them, since compiling builds each stage's part.
- Shared state speaks its own protocol: no HTTP errors, no aiohttp, no prometheus-client. What a
  refusal looks like to a client, and what is exported, are decided above it.

Imports are read from the source (`ast`); the stage rules also follow runtime imports
transitively: a stage that reaches the server through a helper module breaks its rule as surely
as one importing it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gateway"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("config",),
    ("errors", "deadline", "watched"),
    ("tokenizer", "state", "upstream", "tls"),
    ("observability",),  # what a stage observes into: histograms, counters, traces, loop lag
    ("context",),
    ("api", "admit"),
    ("pick", "fleet"),
    ("request",),
    ("policy",),
    ("exporter",),  # what a scrape reads from the live pools, replicas and state
    ("runtime",),  # the process: policy, live pools, reloads, background tasks
    ("pipeline",),
    ("server",),
    ("cli",),
    ("__main__",),
)
STAGES = tuple(
    f"gateway.request.{m.stem}"
    for m in sorted((PACKAGE / "request").glob("*.py"))
    if m.stem != "__init__"
)
ABOVE_STAGES = ("gateway.runtime", "gateway.pipeline", "gateway.server", "gateway.cli")
STATE = "gateway.state"
NOT_IN_STATE = (
    "gateway.errors",
    "aiohttp",
    "prometheus_client",
    "gateway.observability",
    "gateway.exporter",
)
STATE_FACE = ("gateway.state", "gateway.state.base", "gateway.state.build")


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
            # `from gateway.fleet import adapters` imports the module `adapters`
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


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def _layer(package: str) -> int:
    for index, layer in enumerate(LAYERS):
        if package in layer:
            return index
    raise AssertionError(f"gateway.{package} is in no layer of LAYERS: place it")


def test_every_package_has_a_layer() -> None:
    for module in _modules():
        if module != "gateway":
            _layer(_package(module))


def test_a_package_imports_only_the_layers_below_it() -> None:
    broken = []
    for module in _modules():
        if module == "gateway":
            continue
        own = _package(module)
        for name in imports(module, with_type_only=True):
            if not name.startswith("gateway."):
                continue
            other = _package(name)
            if other != own and _layer(other) >= _layer(own):
                broken.append(f"{module} imports {name} ({other} is not below {own})")
    assert sorted(broken) == []


def test_the_stages_are_found() -> None:
    modules = _modules()
    assert {"gateway.pipeline", "gateway.runtime", "gateway.request.count"} <= modules.keys()
    assert len(STAGES) >= 10


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_imports_neither_the_runtime_nor_the_server(stage: str) -> None:
    assert _breaks([stage], ABOVE_STAGES) == []


def test_state_imports_no_http_errors_and_no_prometheus() -> None:
    modules = [m for m in _modules() if _within(m, STATE)]
    assert _breaks(modules, NOT_IN_STATE) == []


def test_only_the_state_names_a_backend() -> None:
    outside = [m for m in _modules() if not _within(m, STATE)]
    named = [
        f"{module} imports {name}"
        for module in outside
        for name in imports(module, with_type_only=True)
        if _within(name, STATE) and name not in STATE_FACE
    ]
    assert named == []


def test_a_rule_broken_is_seen() -> None:
    """The checker itself: a module that reaches the server through another is caught, and a
    package importing its own layer or one above is named."""
    chains = reachable("gateway.runtime")
    assert "gateway.policy.compile" in chains
    assert _breaks(["gateway.runtime"], ("gateway.config.schema",)) != []
    assert _layer("request") > _layer("context") and _layer("policy") > _layer("request")
