"""`llm-gateway serve | check | explain | schema`."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from gateway import __version__
from gateway.policy.load import PolicyError

log = logging.getLogger("gateway")


async def _serve(policy_path: str, host: str, port: int) -> int:
    from aiohttp import web

    from gateway.policy.compile import load_policy
    from gateway.server.app import GATEWAY, create_app, create_metrics_app
    from gateway.server.protocol import GatewayRunner

    policy = load_policy(policy_path)
    server = policy.spec.server
    app = create_app(policy, access_log=sys.stdout.buffer)
    # transformers, the tokenizer and pydantic leave ~100k long-lived objects: without this every
    # full collection walks them all and stalls the event loop for ~60 ms (docs/benchmarks.md).
    gc.collect()
    gc.freeze()
    # Signals are handled before the listener opens: a SIGHUP right after start must not kill us.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[object]] = set()

    def reload_on_hup() -> None:
        task = loop.create_task(app[GATEWAY].reload())
        reloads.add(task)
        task.add_done_callback(reloads.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # logged by reload

    loop.add_signal_handler(signal.SIGHUP, reload_on_hup)
    runner = GatewayRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=server.drain_grace_s
    )
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=1024).start()
    for address in runner.addresses:
        log.info("listening on http://%s:%s (policy %s)", address[0], address[1], policy_path)
    runners = [runner]
    if server.metrics_port is not None:  # its labels name tenants and replicas: not public
        metrics = GatewayRunner(create_metrics_app(app), access_log=None)
        await metrics.setup()
        runners.append(metrics)
        await web.TCPSite(metrics, host, server.metrics_port).start()
        log.info("metrics on http://%s:%s/metrics", host, server.metrics_port)
    await stop.wait()
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

    try:
        return uvloop.run(_serve(args.policy, args.host, args.port))
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1


def check(args: argparse.Namespace) -> int:
    from gateway.policy.compile import load_policy

    try:
        policy = load_policy(args.file, load_tokenizers=args.load_tokenizers)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    policy.close()
    pools = ", ".join(
        f"{name} ({len(p.spec.replicas)} x {p.spec.max_concurrency})"
        for name, p in policy.pools.items()
    )
    print(f"{args.file}: ok — {len(policy.models)} model(s), pools: {pools}")
    return 0


def _endpoint(body: dict[str, Any], given: str | None) -> str:
    if given:
        return given
    return "chat" if "messages" in body else "completions"


async def _explain(policy_path: str, raw: bytes, endpoint: str | None) -> dict[str, Any]:
    from multidict import CIMultiDict, CIMultiDictProxy

    from gateway.context import Ctx
    from gateway.forward import upstream_priority
    from gateway.parse import parse
    from gateway.pipeline import decide
    from gateway.policy.compile import load_policy

    policy = load_policy(policy_path)
    try:
        body = orjson.loads(raw)
        chosen = _endpoint(body if isinstance(body, dict) else {}, endpoint)
        ctx = Ctx(
            request_id="explain",
            endpoint=chosen,
            path=f"/v1/{'chat/completions' if chosen == 'chat' else 'completions'}",
            headers=CIMultiDictProxy(CIMultiDict()),
            arrived=time.perf_counter(),
        )
        parse(ctx, "application/json", raw, policy.spec.server)
        await decide(ctx, policy)
    finally:
        policy.close()
    assert ctx.pool is not None and ctx.route is not None
    return {
        "endpoint": ctx.endpoint,
        "requested_model": ctx.requested_model,
        "input_tokens": ctx.input_tokens,
        "tokenizer": ctx.pool.model.spec.tokenizer,
        "expected_output_tokens": ctx.expected_output,
        "estimate_source": ctx.estimate_source,
        "class": ctx.workload,
        "route": ctx.route.label,
        "pool": ctx.pool.name,
        "adapter": ctx.adapter or None,
        "rewritten_model": ctx.upstream_model,  # the `model` the replica gets
        "upstream_priority": upstream_priority(ctx),
        "reserved_tokens": ctx.reserved_tokens,
    }


def explain(args: argparse.Namespace) -> int:
    from gateway.errors import GatewayError

    try:
        decision = asyncio.run(
            _explain(args.policy, Path(args.request).read_bytes(), args.endpoint)
        )
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    except GatewayError as exc:
        print(f"refused: {exc.status} {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except (OSError, orjson.JSONDecodeError) as exc:
        print(f"cannot read {args.request}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(orjson.dumps(decision, option=orjson.OPT_INDENT_2).decode())
    else:
        width = max(map(len, decision))
        for key, value in decision.items():
            print(f"{key:<{width}}  {value}")
    return 0


def schema(args: argparse.Namespace) -> int:
    from gateway.policy.schema import PolicySpec

    print(
        orjson.dumps(
            PolicySpec.model_json_schema(by_alias=True), option=orjson.OPT_INDENT_2
        ).decode()
    )
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
    p.set_defaults(func=serve)
    p = sub.add_parser("check", help="validate a policy file")
    p.add_argument("file")
    p.add_argument(
        "--load-tokenizers", action="store_true", help="also load every tokenizer directory"
    )
    p.set_defaults(func=check)
    p = sub.add_parser("explain", help="show how a request would be handled, offline")
    p.add_argument("--policy", required=True)
    p.add_argument("--endpoint", choices=["chat", "completions"])
    p.add_argument("--json", action="store_true")
    p.add_argument("request", help="a JSON request body")
    p.set_defaults(func=explain)
    p = sub.add_parser("schema", help="print the policy JSON Schema (policies/schema.json)")
    p.set_defaults(func=schema)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    result: int = args.func(args)
    return result
