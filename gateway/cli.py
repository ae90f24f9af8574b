"""`llm-gateway serve | check | explain | schema`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import getpass
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from gateway import __version__
from gateway.api import BY_NAME
from gateway.config.load import LoadedSpec, PolicyError
from gateway.request.authenticate import key_entry

if TYPE_CHECKING:
    from gateway.config.schema import RouteMatch
    from gateway.context.ctx import Ctx
    from gateway.server.workers import WorkerRole

log = logging.getLogger("gateway")


async def _serve(policy_path: str, host: str, port: int, worker: WorkerRole | None) -> int:
    """One gateway: alone, or worker `worker.index` of a pod's (gateway/server/workers.py), which
    shares its port, passes its reloads to the others and serves its metrics to the parent."""
    from aiohttp import web

    from gateway.config.load import load_spec
    from gateway.policy.compile import compile_policy, reference_problems
    from gateway.server.app import GATEWAY, create_app, create_metrics_app, create_starting_app
    from gateway.server.protocol import GatewayRunner
    from gateway.server.workers import watch_parent
    from gateway.tls import ListenerTls

    loaded = load_spec(policy_path, reference_problems)
    server = loaded.spec.server
    reuse_port = worker is not None
    tls = ListenerTls(server.tls, Path(loaded.path).parent) if server.tls is not None else None
    context = tls.context if tls is not None else None
    scheme = "https" if context is not None else "http"
    loop = asyncio.get_running_loop()
    # Signals are handled before the listener opens: a SIGHUP right after start must not kill
    # us. One during the load reloads once the gateway serves: the file may have changed since.
    hup_while_loading = asyncio.Event()
    loop.add_signal_handler(signal.SIGHUP, hup_while_loading.set)
    # While the tokenizers load (seconds, a minute for several large ones on a small CPU), the
    # listener answers the probes: alive, not ready (`create_starting_app`). The load runs on a
    # thread so that the loop answers them meanwhile.
    # A worker started again after a crash does not: on a shared port its 503s would reach
    # clients the other workers serve meanwhile.
    starting = GatewayRunner(create_starting_app(), access_log=None, shutdown_timeout=0.1)
    await starting.setup()
    if worker is None or not worker.restarted:
        await web.TCPSite(
            starting, host, port, backlog=1024, ssl_context=context, reuse_port=reuse_port
        ).start()
        port = starting.addresses[0][1]  # `--port 0`: the port the system gave, kept for serving
        log.info(
            "answering probes on %s://%s:%s while policy %s loads", scheme, host, port, policy_path
        )
    try:
        loaded_at = time.perf_counter()
        policy = await asyncio.to_thread(
            lambda: compile_policy(loaded, share=worker.count if worker else 1)
        )
        log.info("policy %s loaded in %.1f s", policy_path, time.perf_counter() - loaded_at)
        app = create_app(
            policy, access_log=sys.stdout.buffer, workers=worker.count if worker else 1
        )
        # transformers, the tokenizer and pydantic leave a great many long-lived objects:
        # without this every full collection walks them all and stalls the event loop
        # (docs/benchmarks-history.md).
        gc.collect()
        gc.freeze()
        # Requests in flight keep a young generation of a few thousand objects that refcounting
        # frees; at the default threshold (700 allocations net) the collector runs every few
        # short requests under load and finds nothing. Cycles still get collected, after 10,000
        # net allocations: a short pause, rarely.
        gc.set_threshold(10_000)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if worker is not None:
            orphaned = loop.create_task(watch_parent(stop), name="parent-watch")
        reloads: set[asyncio.Task[object]] = set()

        def reload_on_hup() -> None:
            task = loop.create_task(app[GATEWAY].reload())
            reloads.add(task)
            task.add_done_callback(reloads.discard)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # logged by reload

        runner = GatewayRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=server.drain_grace_s
        )
        await runner.setup()
    finally:
        await starting.cleanup()  # the port is the gateway's own next, at once
    tls = app[GATEWAY].listener_tls
    context = tls.context if tls is not None else None
    await web.TCPSite(
        runner, host, port, backlog=1024, ssl_context=context, reuse_port=reuse_port
    ).start()
    loop.add_signal_handler(signal.SIGHUP, reload_on_hup)
    if hup_while_loading.is_set():
        reload_on_hup()
    runners = [runner]
    if server.metrics_port is not None:  # its labels name tenants and replicas: not public
        metrics = GatewayRunner(create_metrics_app(app), access_log=None)
        await metrics.setup()
        runners.append(metrics)
        if worker is None:
            await web.TCPSite(metrics, host, server.metrics_port).start()
            log.info("metrics on http://%s:%s/metrics", host, server.metrics_port)
        else:  # last: the parent reads the socket's presence as "this worker serves"
            await web.UnixSite(metrics, worker.metrics_socket).start()
    for address in runner.addresses:  # last: every listener is open once this is said
        log.info("listening on %s://%s:%s (policy %s)", scheme, address[0], address[1], policy_path)
    await stop.wait()
    if worker is not None:
        orphaned.cancel()
    app[GATEWAY].draining = True
    log.info(
        "draining: readiness off for %.1fs, then up to %.1fs for in-flight requests",
        server.readiness_delay_s,
        server.drain_grace_s,
    )
    await asyncio.sleep(server.readiness_delay_s)
    for each in runners:
        await each.cleanup()
    log.info("stopped")
    return 0


def serve(args: argparse.Namespace) -> int:
    import uvloop

    from gateway.server.workers import WorkerRole, supervise

    if args.workers < 1:
        print("--workers must be at least 1", file=sys.stderr)
        return 2
    if args.workers > 1 and args.worker_index is None:
        return supervise(args.policy, args.host, args.port, args.workers)
    worker = None
    if args.worker_index is not None:
        worker = WorkerRole(
            args.worker_index, args.workers, args.metrics_socket, args.worker_restarted
        )
    try:
        return uvloop.run(_serve(args.policy, args.host, args.port, worker))
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1


def check(args: argparse.Namespace) -> int:
    from gateway.policy.compile import load_policy
    from gateway.tokenizer.counters import HFCounter

    try:
        policy = load_policy(
            args.file,
            load_tokenizers=args.load_tokenizers,
            tokenizer_files=not args.skip_tokenizers,
        )
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    pools = ", ".join(
        f"{name} ({len(p.spec.replicas)} x {p.spec.max_concurrency})"
        for name, p in policy.pools.items()
    )
    print(f"{args.file}: ok — {len(policy.models)} model(s), pools: {pools}")
    if args.load_tokenizers:  # which library `serve` counts each model with (`tokenizer_backend`)
        counted = {
            name: m.counter.backend
            for name, m in policy.models.items()
            if isinstance(m.counter, HFCounter)
        }
        print("counted by: " + (", ".join(f"{n} {b}" for n, b in counted.items()) or "estimate"))
    policy.close()
    return 0


def _request_bytes(name: str) -> bytes:
    if name != "-":
        return Path(name).read_bytes()
    if sys.stdin is None:  # closed (`<&-`): said as a file that cannot be read
        raise OSError("standard input is closed")
    return sys.stdin.buffer.read()


def _guessed(body: dict[str, Any]) -> str:
    """The endpoint of a JSON body `explain` was given none for, guessed from its shape."""
    if "query" in body:
        return "rerank"
    if any(side in body for side in ("text_1", "data_1", "queries")):
        return "score"
    if "input" in body:
        return "embeddings"
    return "completions" if "prompt" in body and "messages" not in body else "chat"


_NO_TOKENIZER_HINT = (
    "explain --tokenizer-fallback estimate counts such models with the character estimate"
    " (`tokenizer: estimate`) instead"
)


def _header(text: str) -> tuple[str, str]:
    """`Name: value`, as curl's `-H` takes it."""
    name, colon, value = text.partition(":")
    if not colon or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not `Name: value`")
    return name.strip(), value.strip()


def _without_tokenizers(loaded: LoadedSpec, fallback: bool) -> tuple[LoadedSpec, dict[str, str]]:
    """The spec with each model whose tokenizer directory is missing here counted by estimate
    (when `fallback`), and those models' directories: a laptop rarely holds the fleet's."""
    from gateway.policy.compile import tokenizer_dir

    base = Path(loaded.path).parent
    missing = {
        name: str(tokenizer_dir(model, base))
        for name, model in loaded.spec.models.items()
        if model.tokenizer != "estimate" and not tokenizer_dir(model, base).is_dir()
    }
    if not (missing and fallback):
        return loaded, missing
    models = {
        name: model.model_copy(update={"tokenizer": "estimate"}) if name in missing else model
        for name, model in loaded.spec.models.items()
    }
    # explain picks no replica, and `precise_prefix` would refuse a model counted by estimate
    pools = {
        name: pool.model_copy(update={"pick": None})
        if pool.model in missing and pool.pick is not None and "precise_prefix" in pool.pick.scorers
        else pool
        for name, pool in loaded.spec.pools.items()
    }
    spec = loaded.spec.model_copy(update={"models": models, "pools": pools})
    return dataclasses.replace(loaded, spec=spec), missing


def _counted_by_reference(loaded: LoadedSpec) -> LoadedSpec:
    """The spec with every model counted by the tokenizers library, vLLM's own: the same counts
    as fastokens (a policy whose fastokens disagrees does not load), without building fastokens
    and its self-check for one request, most of a start's time (`make bench-startup`)."""
    models = {
        name: model.model_copy(update={"tokenizer_backend": "tokenizers"})
        for name, model in loaded.spec.models.items()
    }
    return dataclasses.replace(loaded, spec=loaded.spec.model_copy(update={"models": models}))


def _assumed(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        if sep and name and float(value) >= 0:
            return name, float(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: give POOL=NUMBER, the number 0 or more")


_REPLICA_LOAD = ("running", "prefill", "context")


def _replica_load(text: str) -> tuple[str, dict[str, int]]:
    url, sep, given = text.rpartition("=")
    load: dict[str, int] = {}
    try:
        for part in given.split(","):
            key, _, value = part.partition(":")
            if key not in _REPLICA_LOAD or int(value) < 0:
                raise ValueError(key)
            load[key] = int(value)
    except ValueError:
        load = {}
    if not (sep and url and load):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give URL=running:N,prefill:TOKENS,context:TOKENS (any of them, 0 or more)"
        )
    return url, load


def _predictions(ctx: Any, loads: dict[str, dict[str, int]]) -> list[str] | None:
    """Each of the pool's static replicas' prediction for the request by the policy's seed
    model (`slo.model`; a running gateway's has learned since), at the loads assumed."""
    from gateway.admit import Claim, Replica
    from gateway.admit.latency import LatencyModel

    spec = ctx.pool.spec
    if spec.slo is None:
        return None
    model, claim = LatencyModel(spec.slo.model), Claim.of(ctx)
    lines = []
    for url in spec.replicas:
        replica = Replica(url, spec.max_concurrency, spec.max_inflight_tokens)
        load = loads.get(url, {})
        state = model.of(replica)
        state.decoding, state.prefill_tokens = load.get("running", 0), load.get("prefill", 0)
        replica.inflight_tokens = load.get("context", 0)
        predicted = model.predict(replica, claim, 0.0)
        line = (
            f"{url}: TTFT {1000 * predicted.ttft_s:.0f} ms, TPOT {1000 * predicted.tpot_s:.1f} ms"
        )
        if ctx.objective is not None:
            room = predicted.headroom(ctx.objective, ctx.arrived)
            line += f" (headroom {room:.0%}: {'meets' if room >= 0 else 'misses'})"
        lines.append(line)
    return lines or ["replicas found by DNS: none to predict here"]


def _objective(ctx: Any) -> str | None:
    objective = ctx.objective
    if objective is None:
        return None
    stated = [
        f"{name} {1000 * value:.0f} ms"
        for name, value in (("TTFT", objective.ttft_s), ("TPOT", objective.tpot_s))
        if value != float("inf")
    ]
    return ", ".join(stated)


@dataclasses.dataclass(frozen=True)
class _AssumedLoad:
    """A pool's load as the explain command line states it (`place.PoolLoad`)."""

    saturation: float
    wait_s: float | None

    def predicted_wait(self, workload: str) -> float | None:
        return self.wait_s if self.wait_s is not None else (0.0 if self.saturation < 1 else None)


def _passed_over_text(why: str) -> str:
    """`Placement.passed_over`'s reason, as explain says it: one of spilling's conditions, or
    the label of the fallback's rule that refused the request."""
    from gateway.request import place

    return {
        place.TIER: "not for tier {tier}",
        place.PRIMARY_HAS_ROOM: "{primary} is not full",
        place.FALLBACK_FULL: "{pool} is full too (saturation {load:g} >= {bound:g})",
    }.get(why, "{pool} cannot serve it ({why})")


def _fallbacks(
    ctx: Ctx, heard: dict[str, str | None], loads: dict[str, _AssumedLoad]
) -> list[str] | None:
    """The route's fallback chain, each with what placement said of it at the load assumed."""
    from gateway.config.schema import PRIORITIES

    assert ctx.route is not None
    if not ctx.route.fallbacks:
        return None
    primary, lines = ctx.route.pool, []
    for fallback in ctx.route.fallbacks:
        when = [
            *([f"saturation >= {fallback.saturation_gte:g}"] if fallback.saturation_gte else []),
            *(
                [f"predicted wait >= {fallback.predicted_wait_gte_s:g}s"]
                if fallback.predicted_wait_gte_s
                else []
            ),
        ]
        tiers = "+".join(PRIORITIES[t] for t in sorted(fallback.tiers))
        rule = (
            f"{fallback.pool.name} (when {primary.name} {' or '.join(when)};"
            f" while under {fallback.below_saturation:g}; tiers {tiers})"
        )
        name = fallback.pool.name
        if name not in heard:
            verdict = "not reached"
        elif (why := heard[name]) is None:
            verdict = "TAKES IT"
        else:
            verdict = "passed over: " + _passed_over_text(why).format(
                tier=PRIORITIES[ctx.priority],
                primary=primary.name,
                pool=name,
                load=loads[name].saturation,
                bound=fallback.below_saturation,
                why=why,
            )
        lines.append(f"{rule}: {verdict}")
    return lines


def _match(spec: RouteMatch) -> str:
    """A route's conditions as the policy writes them: why the request took it."""
    given = spec.model_dump(by_alias=True, exclude_none=True)
    return ", ".join(f"{key} {orjson.dumps(value).decode()}" for key, value in given.items()) or (
        "anything"
    )


async def _explain(
    policy_path: str,
    raw: bytes,
    endpoint: str | None,
    headers: list[tuple[str, str]],
    tokenizer_fallback: bool,
    saturation: dict[str, float] | None = None,
    waits: dict[str, float] | None = None,
    replica_loads: dict[str, dict[str, int]] | None = None,
) -> dict[str, Any]:
    from multidict import CIMultiDict, CIMultiDictProxy

    from gateway.api import CHAT
    from gateway.config.load import load_spec
    from gateway.config.schema import COUNT_BY_CHARS, PRIORITIES
    from gateway.context.ctx import Ctx
    from gateway.pipeline import decide
    from gateway.policy.compile import compile_policy, reference_problems
    from gateway.request.authenticate import authenticate
    from gateway.request.forward import upstream_priority
    from gateway.request.parse import parse
    from gateway.request.quota import reservation, tenant_windows
    from gateway.tokenizer.counters import HFCounter

    loaded, missing = _without_tokenizers(
        load_spec(policy_path, reference_problems), tokenizer_fallback
    )
    try:
        policy = compile_policy(_counted_by_reference(loaded))
    except PolicyError as exc:
        if missing and not tokenizer_fallback:
            raise PolicyError([*exc.lines, _NO_TOKENIZER_HINT]) from None
        raise
    unknown = sorted({*(saturation or {}), *(waits or {})} - policy.pools.keys())
    if unknown:
        policy.close()
        raise PolicyError([f"--saturation / --predicted-wait: no pool {', '.join(unknown)}"])
    try:
        given = {name.lower(): value for name, value in headers}.get("content-type")
        if endpoint is None:  # the guess reads a JSON body's fields, decoded as chat's are
            endpoint = _guessed(CHAT.decode(raw, given or CHAT.content_type, policy.spec.server))
        api = BY_NAME[endpoint]
        ctx = Ctx(
            request_id="explain",
            api=api,
            path=api.path,
            headers=CIMultiDictProxy(CIMultiDict(headers)),
            arrived=time.perf_counter(),
        )
        # The server answers 401 to a request without a key; explain still shows where it goes.
        keyless = bool(policy.tenants) and not (
            "Authorization" in ctx.headers or "x-api-key" in ctx.headers
        )
        if not keyless:
            authenticate(ctx, policy.tenants)
        parse(ctx, given or api.content_type, raw, policy.spec.server)
        loads = {
            name: _AssumedLoad((saturation or {}).get(name, 0.0), (waits or {}).get(name))
            for name in policy.pools
        }
        heard: dict[str, str | None] = {}
        await decide(
            ctx, policy, loads, lambda fallback, why: heard.update({fallback.pool.name: why})
        )
        fallbacks = _fallbacks(ctx, heard, loads)
    finally:
        policy.close()
    assert ctx.pool is not None and ctx.route is not None and ctx.model is not None
    model = ctx.model  # whose tokenizer counted: an alias's first route's
    tenant = ctx.tenant
    quota: list[str] | str | None = None
    if keyless:
        quota = "no key given: the gateway answers 401"
    elif tenant is not None:
        charged = tenant_windows(tenant, ctx, reservation(ctx))
        quota = [f"{w.kind} {w.limit.amount} of {w.limit.limit}/min{w.where}" for w in charged]
        quota = quota or "unlimited"
    # Which library encoded the rendered prompt (gateway/tokenizer/backends.py), or the character estimate.
    counter = model.counter
    backend = counter.backend if isinstance(counter, HFCounter) else COUNT_BY_CHARS
    return {
        "endpoint": ctx.endpoint,
        "requested_model": ctx.requested_model,
        "tenant": tenant.name if tenant is not None else None,  # never the key
        "tier": PRIORITIES[ctx.tier] if tenant is not None else None,
        "priority": PRIORITIES[ctx.priority],
        "quota": quota,
        "input_tokens": ctx.input_tokens,
        "tokenizer": missing.get(model.name, model.spec.tokenizer),
        "tokenizer_missing": model.name in missing,
        "counting_backend": backend,
        "expected_output_tokens": ctx.expected_output,
        "estimate_source": ctx.estimate_source,
        "class": ctx.workload,
        "route": ctx.route.label,
        "route_match": _match(policy.spec.routes[ctx.route.index].match),
        "fallback": fallbacks,
        "pool": ctx.pool.name,
        "spilled_from": ctx.spilled_from or None,
        "adapter": ctx.adapter or None,
        "rewritten_model": ctx.upstream_model,  # the `model` the replica gets
        "upstream_priority": upstream_priority(ctx),
        "reserved_tokens": ctx.held_tokens,
        "objective": _objective(ctx),
        "predicted": _predictions(ctx, replica_loads or {}),
    }


def _lines(decision: dict[str, Any]) -> list[str]:
    shown = {k: v for k, v in decision.items() if k != "tokenizer_missing"}
    if decision["tokenizer_missing"]:
        shown["input_tokens"] = (
            f"{decision['input_tokens']} (estimated: tokenizer {decision['tokenizer']} not found)"
        )
        shown["tokenizer"] = f"estimate (fallback for {decision['tokenizer']})"
    if isinstance(shown["quota"], list):
        shown["quota"] = "; ".join(shown["quota"])
    if shown["objective"] is None:  # no `slo` on the pool, or none for this request
        del shown["objective"]
    if shown["predicted"] is None:
        del shown["predicted"]
    else:
        shown["predicted"] = "; ".join(shown["predicted"])
    if shown["fallback"] is None:  # a route without fallbacks: nothing to say of them
        del shown["fallback"], shown["spilled_from"]
    else:
        shown["fallback"] = "; then ".join(shown["fallback"])
    width = max(map(len, shown))
    return [f"{key:<{width}}  {value}" for key, value in shown.items()]


def _api_key(source: str, request: str) -> str:
    """The tenant key `explain --api-key-file` names: the first line of a file, or of standard
    input (`-`; asked for without echo at a terminal). Never an argument: argv is in the shell's
    history and in every process listing."""
    if source != "-":
        lines = Path(source).read_text().splitlines()
    elif request == "-":
        raise OSError("standard input holds the request; give the key in a file")
    elif sys.stdin is None:
        raise OSError("standard input is closed")
    elif sys.stdin.isatty():
        lines = [getpass.getpass("API key (not echoed): ")]
    else:
        lines = sys.stdin.read().splitlines()
    key = lines[0].strip() if lines else ""
    if not key:
        raise OSError("no key in it")
    return key


def explain(args: argparse.Namespace) -> int:
    from gateway.errors import GatewayError

    headers = list(args.header)
    if args.api_key_file is not None:  # the server resolves the tenant from this header alone
        try:
            key = _api_key(args.api_key_file, args.request)
        except OSError as exc:
            print(f"cannot read the key from {args.api_key_file}: {exc}", file=sys.stderr)
            return 1
        headers = [(k, v) for k, v in headers if k.lower() != "authorization"]
        headers.append(("Authorization", f"Bearer {key}"))
    try:
        decision = asyncio.run(
            _explain(
                args.policy,
                _request_bytes(args.request),
                args.endpoint,
                headers,
                args.tokenizer_fallback == "estimate",
                dict(args.saturation),
                dict(args.predicted_wait),
                dict(args.replica_load),
            )
        )
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    except GatewayError as exc:
        print(f"refused: {exc.status} {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"cannot read {args.request}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(orjson.dumps(decision, option=orjson.OPT_INDENT_2).decode())
    else:
        print("\n".join(_lines(decision)))
    return 0


def schema(args: argparse.Namespace) -> int:
    from gateway.policy.compile import json_schema

    print(orjson.dumps(json_schema(), option=orjson.OPT_INDENT_2).decode())
    return 0


def hash_key(args: argparse.Namespace) -> int:
    """Print, for each key on standard input (one a line; asked for without echo at a
    terminal), the entry a tenant's `keys` takes. Never from the command line: argv is in the
    shell's history and in every process listing."""
    if sys.stdin.isatty():
        keys = [getpass.getpass("API key (not echoed): ").strip()]
    else:
        keys = [line.strip() for line in sys.stdin.read().splitlines() if line.strip()]
    if not keys or not all(keys):
        print("llm-gateway hash-key: no key on standard input", file=sys.stderr)
        return 2
    for key in keys:
        print(key_entry(key))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llm-gateway", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the gateway")
    p.add_argument("--policy", required=True, help="the policy file (YAML); SIGHUP reloads it")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on, the metrics port's too (default: %(default)s; 0.0.0.0: all)",
    )
    p.add_argument("--port", type=int, default=8080, help="port for the API (default: %(default)s)")
    p.add_argument(
        "--workers",
        type=int,
        default=os.environ.get("LLM_GATEWAY_WORKERS", "1"),  # argparse converts it, or says why
        help=(
            "gateway processes sharing the port, one per core the pod has; more than 1 needs"
            " state.backend: redis and server.metrics_port (default: $LLM_GATEWAY_WORKERS or 1)"
        ),
    )
    # Set by the parent of `--workers N` on each worker it starts.
    p.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--metrics-socket", help=argparse.SUPPRESS)
    p.add_argument("--worker-restarted", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=serve)
    p = sub.add_parser("check", help="validate a policy file")
    p.add_argument("file")
    tokenizers = p.add_mutually_exclusive_group()
    tokenizers.add_argument(
        "--load-tokenizers",
        action="store_true",
        help="load every tokenizer as serve does (default: only check that each directory holds"
        " tokenizer.json, and a chat template where a route sends the model chat requests)",
    )
    tokenizers.add_argument(
        "--skip-tokenizers",
        action="store_true",
        help="do not look at the tokenizer directories (a machine without them)",
    )
    p.set_defaults(func=check)
    p = sub.add_parser(
        "explain",
        help="show how a request would be handled, offline",
        allow_abbrev=False,  # `--api-key SECRET` must fail, not read a file named SECRET
    )
    p.add_argument("--policy", required=True, help="the policy file (YAML)")
    p.add_argument(
        "--endpoint",
        choices=sorted(BY_NAME),
        help="default: completions when the body has `prompt` and no `messages`, else chat"
        " (an Anthropic /v1/messages body needs `--endpoint messages`)",
    )
    p.add_argument(
        "-H",
        "--header",
        action="append",
        type=_header,
        default=[],
        metavar="'NAME: VALUE'",
        help="a request header, as curl's -H (repeatable): route `header` rules, x-priority",
    )
    p.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="a file whose first line is the tenant key, or - for standard input (sent as"
        " `Authorization: Bearer KEY`); the output names the tenant, never the key",
    )
    p.add_argument(
        "--tokenizer-fallback",
        choices=["estimate"],
        help="count models whose tokenizer directory is missing here with the character estimate",
    )
    p.add_argument(
        "--saturation",
        action="append",
        type=_assumed,
        default=[],
        metavar="POOL=X",
        help="assume the pool's saturation ((in flight + waiting) / capacity) is X, to see which"
        " route fallback would take the request (repeatable; default: every pool idle, 0)",
    )
    p.add_argument(
        "--predicted-wait",
        action="append",
        type=_assumed,
        default=[],
        metavar="POOL=S",
        help="assume a new request would wait S seconds for a slot on the pool (repeatable;"
        " default: 0 where saturation is under 1, else unknown)",
    )
    p.add_argument(
        "--replica-load",
        action="append",
        type=_replica_load,
        default=[],
        metavar="URL=running:N,prefill:T,context:T",
        help="on a pool with `slo`, assume the replica has N sequences decoding, T prompt tokens"
        " still to prefill and T tokens of context in flight, to see its predicted latency for"
        " the request (repeatable; default: every replica idle)",
    )
    p.add_argument("--json", action="store_true", help="print the decision as JSON")
    p.add_argument(
        "request",
        help="a file holding the request body, or - for standard input (a body that is not JSON,"
        " a multipart upload, needs --endpoint and its -H 'Content-Type: ...')",
    )
    p.set_defaults(func=explain)
    p = sub.add_parser("schema", help="print the policy JSON Schema (policies/schema.json)")
    p.set_defaults(func=schema)
    p = sub.add_parser(
        "hash-key",
        help="print what a tenant's `keys` takes for each key read from standard input",
        description=hash_key.__doc__,
    )
    p.set_defaults(func=hash_key)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    result: int = args.func(args)
    return result
