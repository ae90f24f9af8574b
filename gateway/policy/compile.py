"""Turn a validated `PolicySpec` into the immutable runtime `Policy`, once.

Everything a request would otherwise redo is done here: tokenizers loaded, class and route
predicates built, plug-ins made, cross-references checked. A reload builds a new `Policy`
and swaps one reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.admit.picking import Picker
from gateway.api import BY_NAME, BY_PATH
from gateway.config.load import LoadedSpec, PolicyError, Problem, load_spec
from gateway.config.plugins import PluginError, create, lookup, names
from gateway.config.schema import (
    COUNT_BY_CHARS,
    ModelSpec,
    PolicySpec,
    RouteMatch,
    When,
)
from gateway.context.compiled import Model, Pool, Route, Tenant
from gateway.context.objective import Defaults
from gateway.fleet.adapters import Adapters
from gateway.pick import WeightedPicker  # the package registers every picker and scorer
from gateway.request.authenticate import compile_tenants
from gateway.request.checks import pool_checks
from gateway.request.estimate import OutputEstimator
from gateway.request.place import Placement
from gateway.request.route import compile_route
from gateway.request.workload import Workload, compile_class
from gateway.tokenizer.counters import CharCounter, HFCounter, TokenCounter
from gateway.tokenizer.cpus import available_cpus
from gateway.tokenizer.loaded import lacks, return_freed_memory
from gateway.tokenizer.threads import TokenizerThreads


@dataclass(frozen=True, slots=True)
class Policy:
    path: str
    spec: PolicySpec
    models: dict[str, Model]
    pools: dict[str, Pool]
    workloads: tuple[Workload, ...]
    routes: tuple[Route, ...]
    passthrough: dict[str, Route]
    """The routes' passthrough paths, each to its route."""
    picker: Picker
    pickers: dict[str, Picker]
    """Each pool's: its own weighted picker with `pick:`, else the policy's `picker`."""
    estimator: OutputEstimator
    served_models: tuple[str, ...]
    """Names `GET /v1/models` lists: each pool's model and each literal alias a route accepts."""
    adapters: Adapters
    """LoRA adapters and the pools serving them: the policy's lists, and what replicas report."""
    placement: Placement
    """Where a request goes: its route's pool, a fallback or its holder's, each after its rules."""
    tenants: dict[bytes, Tenant]
    """SHA-256 digest of each API key -> its tenant; empty: the gateway is open."""
    tokenizer_threads: TokenizerThreads | None
    """Threads for long tokenizations; a reloaded policy inherits them with its models."""
    digest: str

    def close(self) -> None:
        if self.tokenizer_threads is not None:
            self.tokenizer_threads.shutdown()


def tokenizer_dir(spec: ModelSpec, base: Path) -> Path:
    """Where a model's tokenizer is loaded from: a relative path is the policy file's neighbour."""
    return base / spec.tokenizer


def _counter(
    name: str,
    spec: ModelSpec,
    policy: PolicySpec,
    base: Path,
    threads: TokenizerThreads | None,
    load: bool,
) -> Any:
    if spec.tokenizer == COUNT_BY_CHARS or not load:
        return CharCounter(spec.chars_per_token, spec.image_tokens)
    server = policy.server
    return HFCounter.load(
        str(tokenizer_dir(spec, base)),
        backend=spec.tokenizer_backend,
        model=name,
        threads=threads.small if threads is not None else None,
        inline_max_chars=server.inline_tokenize_max_chars,
        large_threads=threads.large if threads is not None else None,
        large_min_chars=server.large_tokenize_chars,
        image_tokens=spec.image_tokens,
    )


# The endpoints whose requests are rendered by the model's chat template (embeddings and the
# pooling endpoints render one only for a request with `messages`, which a model may never get).
TEMPLATE_ENDPOINTS = frozenset({"chat", "messages", "responses"})


def _tokenizer_files(spec: PolicySpec, base: Path) -> list[Problem]:
    """Each model's tokenizer directory holds what counting needs (`loaded.lacks`): its
    `tokenizer.json`, and a chat template when a route may send it chat requests (a route
    naming no endpoint, or one of `TEMPLATE_ENDPOINTS`, to its pool or a fallback's)."""
    chat: dict[str, int] = {}  # model -> the first route sending it chat requests
    for index, route in enumerate(spec.routes):
        endpoints = route.match.endpoint
        named = {endpoints} if isinstance(endpoints, str) else set(endpoints or ())
        if named and not named & TEMPLATE_ENDPOINTS:
            continue
        for pool in (route.pool, *(f.pool for f in route.fallback)):
            if pool in spec.pools:
                chat.setdefault(spec.pools[pool].model, index)
    problems = []
    for name, model in spec.models.items():
        if model.tokenizer == COUNT_BY_CHARS:
            continue
        why = f"routes.{chat[name]} sends it chat requests" if name in chat else None
        lacking = lacks(tokenizer_dir(model, base), why)
        if lacking is not None:
            problems.append(Problem(("models", name, "tokenizer"), lacking))
    return problems


def _current(counter: TokenCounter) -> bool:
    """Whether a reload may keep `counter`: its tokenizer's files did not change."""
    return not isinstance(counter, HFCounter) or counter.loaded.current


def _cross_check(spec: PolicySpec) -> list[Problem]:
    problems = []
    for name, pool in spec.pools.items():
        if pool.model not in spec.models:
            problems.append(
                Problem(("pools", name, "model"), f"model {pool.model!r} is not under models")
            )
    classes = {c.name for c in spec.classes}
    seen: set[str] = set()
    for index, cls in enumerate(spec.classes):
        if cls.name in seen:
            problems.append(Problem(("classes", index, "name"), f"duplicate class {cls.name!r}"))
        seen.add(cls.name)
    for name, pool in spec.pools.items():
        for cls_name in pool.reserve:
            if cls_name not in classes:
                problems.append(
                    Problem(("pools", name, "reserve", cls_name), f"unknown class {cls_name!r}")
                )
    for name, tenant in spec.tenants.items():
        for model in tenant.models:
            if model not in spec.models:
                problems.append(
                    Problem(("tenants", name, "models", model), f"unknown model {model!r}")
                )
        for pool_name in tenant.pools:
            if pool_name not in spec.pools:
                problems.append(
                    Problem(("tenants", name, "pools", pool_name), f"unknown pool {pool_name!r}")
                )
    for index, route in enumerate(spec.routes):
        if route.pool not in spec.pools:
            problems.append(Problem(("routes", index, "pool"), f"unknown pool {route.pool!r}"))
        wanted = route.match.class_
        for name in [wanted] if isinstance(wanted, str) else wanted or []:
            if not any(c in name for c in "*?[") and name not in classes:
                problems.append(
                    Problem(("routes", index, "match", "class"), f"unknown class {name!r}")
                )
    return problems


def _references(spec: PolicySpec) -> list[Problem]:
    return (
        _cross_check(spec)
        + _scorer_problems(spec)
        + _alias_tokenizers(spec)
        + _adapter_problems(spec)
        + _fallback_problems(spec)
        + _passthrough_problems(spec)
        + _endpoint_problems(spec)
    )


def _endpoint_problems(spec: PolicySpec) -> list[Problem]:
    """A class's or route's `endpoint` names an API the gateway serves (gateway/api/)."""
    problems = []
    known = ", ".join(BY_NAME)
    matches: list[tuple[tuple[str, int, str], When | RouteMatch]] = [
        (("classes", i, "when"), c.when) for i, c in enumerate(spec.classes)
    ]
    matches += [(("routes", i, "match"), r.match) for i, r in enumerate(spec.routes)]
    for where, match in matches:
        given = match.endpoint
        for name in [given] if isinstance(given, str) else given or []:
            if name not in BY_NAME:
                message = f"unknown endpoint {name!r}; known: {known}"
                problems.append(Problem((*where, "endpoint"), message))
    return problems


def _passthrough_problems(spec: PolicySpec) -> list[Problem]:
    """A passthrough path is named by one route only, and is none of the APIs' own paths."""
    problems, seen = [], set()
    for index, route in enumerate(spec.routes):
        for i, path in enumerate(route.passthrough):
            where = ("routes", index, "passthrough", i)
            if path in BY_PATH:
                api = BY_PATH[path].name
                message = f"{path} is the gateway's {api} API, routed by its `model`: remove it"
                problems.append(Problem(where, message))
            elif path in seen:
                problems.append(Problem(where, f"{path} is named by an earlier route already"))
            seen.add(path)
    return problems


def _scorer_problems(spec: PolicySpec) -> list[Problem]:
    """A pool's scorers are registered ones: the schema takes any name, being below the registry
    (`config/plugins.py`), so the names are checked here, as a plug-in's type is."""
    problems = []
    for name, pool in spec.pools.items():
        for scorer in pool.pick.scorers if pool.pick is not None else ():
            try:
                lookup("scorer", scorer)
            except PluginError as exc:
                problems.append(Problem(("pools", name, "pick", "scorers", scorer), str(exc)))
    return problems


def _fallback_problems(spec: PolicySpec) -> list[Problem]:
    """A fallback is another known pool, of the route's model unless the route allows another,
    counted by the same tokenizer: the request's count is not redone when it spills."""
    problems = []
    for index, route in enumerate(spec.routes):
        primary = spec.pools.get(route.pool)
        seen = {route.pool}
        for i, fallback in enumerate(route.fallback):
            where = ("routes", index, "fallback", i, "pool")
            pool = spec.pools.get(fallback.pool)
            if pool is None:
                problems.append(Problem(where, f"unknown pool {fallback.pool!r}"))
                continue
            if fallback.pool in seen:
                problems.append(Problem(where, f"pool {fallback.pool!r} is in the chain already"))
            seen.add(fallback.pool)
            if primary is None or primary.model == pool.model:
                continue
            if not route.allow_model_substitution:
                problems.append(
                    Problem(
                        where,
                        f"pool {fallback.pool!r} serves {pool.model!r}, not {primary.model!r}:"
                        " set `allow_model_substitution: true` on the route to allow it",
                    )
                )
            models = spec.models
            if (
                pool.model in models
                and primary.model in models
                and models[pool.model].tokenizer != models[primary.model].tokenizer
            ):
                problems.append(
                    Problem(
                        where,
                        f"pool {fallback.pool!r} counts with tokenizer"
                        f" {models[pool.model].tokenizer!r}, the route's pool with"
                        f" {models[primary.model].tokenizer!r}: a spilled request keeps its"
                        " count, so both need one tokenizer",
                    )
                )
    return problems


def _alias_tokenizers(spec: PolicySpec) -> list[Problem]:
    """An alias is counted with the tokenizer of its first route, so all its pools must share it."""
    problems = []
    first: dict[str, str] = {}
    for index, route in enumerate(spec.routes):
        model = route.match.model
        pool = spec.pools.get(route.pool)
        if pool is None or pool.model not in spec.models:
            continue
        tokenizer = spec.models[pool.model].tokenizer
        for alias in [model] if isinstance(model, str) else model or []:
            if first.setdefault(alias, tokenizer) != tokenizer:
                problems.append(
                    Problem(
                        ("routes", index, "pool"),
                        f"model {alias!r} already routes to pools with tokenizer"
                        f" {first[alias]!r}; pool {route.pool!r} uses {tokenizer!r} (an alias is"
                        " counted before it is routed: give its models one tokenizer directory)",
                    )
                )
    return problems


def _adapter_problems(spec: PolicySpec) -> list[Problem]:
    """An adapter is a name of its own, trained on one base model: the pools listing it serve
    that model (so its tokenizer counts it wherever it goes)."""
    problems = []
    served = set(_served(spec))
    base: dict[str, str] = {}
    for name, pool in spec.pools.items():
        for index, adapter in enumerate(pool.adapters):
            where = ("pools", name, "adapters", index)
            if adapter in served:
                problems.append(Problem(where, f"{adapter!r} is a model or alias name already"))
            elif base.setdefault(adapter, pool.model) != pool.model:
                problems.append(
                    Problem(
                        where,
                        f"adapter {adapter!r} is listed on a pool of {base[adapter]!r} already;"
                        f" this pool serves {pool.model!r}",
                    )
                )
    return problems


def _served(spec: PolicySpec) -> tuple[str, ...]:
    names: dict[str, None] = {pool.model: None for pool in spec.pools.values()}
    for route in spec.routes:
        model = route.match.model
        for alias in [model] if isinstance(model, str) else model or []:
            if not any(c in alias for c in "*?["):
                names[alias] = None
    return tuple(names)


def compile_policy(
    loaded: LoadedSpec,
    *,
    load_tokenizers: bool = True,
    tokenizer_files: bool = True,
    previous: Policy | None = None,
    share: int = 1,
) -> Policy:
    """Build the runtime policy; raise `PolicyError` naming file, line and field of each problem.
    `share`: the processes that share the container's CPUs (a pod's workers, `serve --workers`);
    without `server.tokenizer_threads`, each starts its share of them, rounded up.

    `load_tokenizers=False` checks a policy without loading its tokenizers (CI): token counting
    then falls back to the character estimate, and each tokenizer directory is only checked to
    hold what counting needs, unless `tokenizer_files=False` too (a machine without the model
    directories: a laptop). With `previous` (a
    reload), what did not change is carried over rather than rebuilt: models with their loaded
    tokenizers (while the tokenizer's files are the same; a changed model whose files are
    finds its tokenizer loaded still, gateway/tokenizer/loaded.py), the tokenizer threads, and
    the output-length estimator with what it learned.
    """
    spec = loaded.spec
    problems = _references(spec)
    plugins, plugin_problems = _plugins(spec, previous)
    problems += plugin_problems
    pickers, picker_problems = _pool_pickers(spec, previous)
    problems += picker_problems
    threads = previous.tokenizer_threads if previous is not None else None
    if (
        threads is None
        and load_tokenizers
        and any(m.tokenizer != COUNT_BY_CHARS for m in spec.models.values())
    ):
        wanted = spec.server.tokenizer_threads
        threads = TokenizerThreads.start(
            -(-available_cpus() // share) if wanted is None else wanted
        )
    base = Path(loaded.path).parent
    tenants, tenant_problems = compile_tenants(spec.tenants, base)
    problems += tenant_problems
    file_problems = _tokenizer_files(spec, base) if load_tokenizers or tokenizer_files else []
    problems += file_problems
    lacking = {problem.loc[1] for problem in file_problems}
    models: dict[str, Model] = {}
    built: list[Model] = []  # counters loaded now, warmed once the policy is known to compile
    reusable = (
        previous.models if previous is not None and previous.spec.server == spec.server else {}
    )
    for name, model_spec in spec.models.items():
        kept = reusable.get(name)
        if name in lacking:
            continue
        if kept is not None and kept.spec == model_spec and _current(kept.counter):
            models[name] = kept
            continue
        try:
            counter = _counter(name, model_spec, spec, base, threads, load_tokenizers)
        except (OSError, ValueError) as exc:
            problems.append(Problem(("models", name, "tokenizer"), f"cannot load: {exc}"))
            continue
        models[name] = Model(name, model_spec, counter)
        built.append(models[name])
    if problems:
        if threads is not None and (previous is None or threads is not previous.tokenizer_threads):
            threads.shutdown()
        raise loaded.error(problems)
    for model in built:
        if isinstance(model.counter, HFCounter):
            model.counter.warm()
    if built:
        return_freed_memory()
    class_objectives = {c.name: c.slo for c in spec.classes}
    pools = {
        name: Pool(
            name,
            pool_spec,
            models[pool_spec.model],
            None if pool_spec.slo is None else Defaults(pool_spec.slo, class_objectives),
        )
        for name, pool_spec in spec.pools.items()
    }
    bases = {name: pool.model for name, pool in spec.pools.items()}
    served = _served(spec)
    routes = tuple(compile_route(i, r, pools) for i, r in enumerate(spec.routes))
    adapters = Adapters(
        bases,
        {name: tuple(pool.adapters) for name, pool in spec.pools.items()},
        frozenset(served),
        previous.adapters.carried(bases) if previous is not None else None,
    )
    return Policy(
        path=loaded.path,
        spec=spec,
        models=models,
        pools=pools,
        workloads=tuple(compile_class(c) for c in spec.classes),
        routes=routes,
        passthrough={path: route for route in routes for path in route.passthrough},
        picker=plugins["picker"],
        pickers={name: pickers.get(name, plugins["picker"]) for name in pools},
        estimator=plugins["output_estimator"],
        served_models=served,
        adapters=adapters,
        placement=Placement(pool_checks(adapters), pools),
        tenants=tenants,
        tokenizer_threads=threads,
        digest=loaded.digest,
    )


def _plugins(spec: PolicySpec, previous: Policy | None) -> tuple[dict[str, Any], list[Problem]]:
    """The picker and output estimator by kind; a reload keeps those whose spec did not change
    (the estimator with what it learned)."""
    plugins: dict[str, Any] = {}
    problems = []
    for kind, plugin in (
        ("picker", spec.plugins.picker),
        ("output_estimator", spec.plugins.output_estimator),
    ):
        if previous is not None and getattr(previous.spec.plugins, kind) == plugin:
            plugins[kind] = getattr(previous, "estimator" if kind == "output_estimator" else kind)
            continue
        try:
            plugins[kind] = create(kind, plugin.type, plugin.parameters)
        except PluginError as exc:
            problems.append(Problem(("plugins", kind), str(exc)))
    return plugins, problems


def reference_problems(spec: PolicySpec) -> list[Problem]:
    """The checks between sections (unknown pools, models, classes; plug-in types) that need no
    file: `load_spec` runs them over what parsed of an invalid policy, so `check` shows all."""
    return _references(spec) + _plugins(spec, None)[1]


def _pool_pickers(
    spec: PolicySpec, previous: Policy | None
) -> tuple[dict[str, Picker], list[Problem]]:
    """A weighted picker per pool with `pick:`; a reloaded pool whose `pick` did not change
    keeps its picker, and with it what its scorers learned (which replica holds which prefix)."""
    pickers: dict[str, Picker] = {}
    problems = []
    for name, pool in spec.pools.items():
        if pool.pick is None:
            continue
        kept = previous.pools.get(name) if previous is not None else None
        if previous is not None and kept is not None and kept.spec.pick == pool.pick:
            pickers[name] = previous.pickers[name]
            continue
        scorers, known = pool.pick.scorers, names("scorer")
        if any(s not in known for s in scorers):
            continue  # `_scorer_problems` names them
        needy = [s for s in scorers if lookup("scorer", s).wants_token_ids]
        if needy and spec.models[pool.model].tokenizer == COUNT_BY_CHARS:
            problems.append(
                Problem(
                    ("pools", name, "pick", "scorers", needy[0]),
                    f"needs model {pool.model!r}'s own tokenizer (not `estimate`): it looks up"
                    " the prompt's token ids",
                )
            )
            continue
        try:
            pickers[name] = WeightedPicker(pool.pick)
        except PluginError as exc:
            problems.append(Problem(("pools", name, "pick", "scorers"), str(exc)))
    return pickers, problems


def json_schema() -> dict[str, Any]:
    """The policy's JSON Schema (`llm-gateway schema`, policies/schema.json): `PolicySpec`'s, with
    the registered scorers' names as the names `pick.scorers` takes, which the schema module,
    below the registry, leaves open."""
    schema = PolicySpec.model_json_schema(by_alias=True)
    properties = schema["$defs"]["PickSpec"]["properties"]
    scorers = {**properties["scorers"], "propertyNames": {"enum": names("scorer")}}
    properties["scorers"] = dict(sorted(scorers.items()))  # pydantic's order: by key
    return schema


def load_policy(
    path: str | Path, *, load_tokenizers: bool = True, tokenizer_files: bool = True
) -> Policy:
    return compile_policy(
        load_spec(path, reference_problems),
        load_tokenizers=load_tokenizers,
        tokenizer_files=tokenizer_files,
    )


__all__ = [
    "Model",
    "Policy",
    "PolicyError",
    "Pool",
    "compile_policy",
    "json_schema",
    "load_policy",
    "reference_problems",
    "tokenizer_dir",
]
