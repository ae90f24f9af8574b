"""The processes and the run: replicas, gateways (one, or two sharing a `redis-server`), tickers.

Order: the scripted replicas and a "secret" local service (what a followed redirect would leak)
on loopback in this process; `redis-server` when two gateways share state; each gateway a real
`python -m gateway serve` with a policy written here (Gemma 3, Llama 3 and Qwen 3 on their real
tokenizers, three tenants whose small TPM/RPM bind); a `/healthz` ticker process per gateway.
Then a quiet baseline, the plan's moves at their times (Redis's replies held for a spell, then
Redis stopped and started again in the middle, when shared), the drain, a quiet period, and a
scrape of what everything reports. Every
process is stopped on the way out, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import redis
import yaml
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from loadtest.adversary.count import Counter
from loadtest.adversary.generator import (
    ENDPOINT_PATHS,
    TIGHT_CLASS_HEADER,
    Generator,
    Move,
    Plan,
    Planned,
    reserved_slots,
    shared_state,
    slow_replies,
)
from loadtest.adversary.replica import PIECE, SECRET, Ledger, Replica
from loadtest.adversary.slow_link import SlowLink
from loadtest.adversary.uploads import MAX_BODY_BYTES
from loadtest.processes import RedisServer, free_port
from loadtest.processes import gateway as gateway_process
from loadtest.real_tokenizers import directory

MODELS = ("gemma3", "llama3", "qwen3")
MAX_MODEL_LEN = 8192
# name -> (tpm, rpm): small enough that the windows bind within a short run, large enough that
# most requests are still admitted (6,000 / 15,000 / 40,000 refused 85% of a run's requests).
TENANTS = {
    "alpha": (15_000, 120),
    "beta": (50_000, 300),
    "gamma": (120_000, 600),
}
BASELINE_S = 3.0  # the ticker's quiet baseline, before any request
QUIET_S = 4.0  # after the drain: corrections, lease releases and renewals settle
DRAIN_S = 45.0  # after the last move, requests still running get this long
CLIENT_CONCURRENCY = 48
REQUEST_TIMEOUT_S = 40.0
SLOW_READ_S = 0.004  # per 4 KiB a slow client reads
REDIS_DOWN = (0.35, 0.55)  # shares of the run: Redis stopped, then started again (empty)
REDIS_SLOW = (0.1, 0.25)  # shares of the run: Redis's replies held (`slow_replies`)
REDIS_TIMEOUT_S = 0.2  # the gateways' bound on a Redis call
# One pool's `max_output_tokens`: the generator's bounds (up to 3,000, times `n` up to 2) cross
# it, and the checks expect its refusal (`checks.check_refusals`).
OUTPUT_CAPS = {"llama3": 2500}
# Pools that admit by latency (`slo`): objectives per tier, tight enough for sheddable work to be
# refused as unreachable; Qwen 3's takes no objective from a header (`headers: false`), Llama
# 3's pool has none (the headers are ignored there, and never sent upstream by any).
SLO: dict[str, dict[str, Any]] = {
    "gemma3": {
        "objectives": {
            "critical": {"ttft_ms": 2500},
            "standard": {"ttft_ms": 1500, "tpot_ms": 100},
            "sheddable": {"ttft_ms": 250, "tpot_ms": 30},
        }
    },
    "qwen3": {"objectives": {"standard": {"ttft_ms": 800}}, "headers": False},
}
# Gemma 3's pool has two replicas (the same scripted one, twice): headroom has a choice, and a
# replica that resets before its head sends the request to the other (a retry).
REPLICAS = {"gemma3": 2}
TIERS = {"gamma": "critical"}  # a tenant's tier; the others are standard
TENANT_SLO = {"beta": {"tpot_ms": 60}}
# The class a header puts a request in, whose objectives no replica can meet.
CLASSES = [
    {"name": "tight", "when": {"header": {TIGHT_CLASS_HEADER: "tight"}},
     "slo": {"ttft_ms": 5, "tpot_ms": 1}},
    {"name": "any", "when": {}},
]  # fmt: skip


def log(message: str) -> None:
    print(f"[adversary {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def key_of(tenant: str) -> str:
    return f"adversary-key-{tenant}"


@dataclass
class Outcome:
    """What a client saw."""

    planned: Planned
    sent_at: float
    status: int = 0
    left_early: bool = False
    received_tokens: int = 0  # output tokens in what the client read
    response_id: str | None = None
    leaked: bool = False
    error: str = ""
    ended: float = 0.0
    retry_after: str | None = None  # a refusal's Retry-After
    refusal: bytes = b""  # the head of a refusal's body (status 400 and over)


@dataclass
class Run:
    seed: int
    gateways: int
    seconds: float
    workers: int = 1  # a gateway's: with more than one, each gateway is a pod
    started: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    ledger: Ledger = field(default_factory=Ledger)
    access: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[str] = field(default_factory=list)  # each gateway's, after the quiet period
    # Per gateway, when a scrape (one a second) found more loop lags over LAG_S than the last.
    lags: list[list[tuple[float, float]]] = field(default_factory=list)
    # Per gateway, each second: (unix second, worst /healthz latency, worst latency the
    # machine's scheduling does not explain: `ticker`).
    ticks: list[list[tuple[float, float, float]]] = field(default_factory=list)
    attack: tuple[float, float] = (0.0, 0.0)
    redis_down: tuple[float, float] | None = None
    # When Redis's replies were held, and how long each: (from, to, seconds)
    redis_slow: tuple[float, float, float] | None = None
    redis_leases: int = 0
    # Per gateway, what asyncio itself logged (at ERROR): a task's exception nobody read, a task
    # destroyed while pending, a client or transport never closed: each a resource lost.
    asyncio_reports: list[list[str]] = field(default_factory=list)
    logs: Path | None = None
    state: dict[str, Any] | None = None  # with Redis, how the gateways share it (`shared_state`)
    reserve: int = 0  # with Redis, a replica's slots kept for `tight` (`reserved_slots`)


def policy(
    replicas: dict[str, list[str]],
    metrics_port: int,
    redis_url: str | None,
    gateways: int,
    backend: str = "auto",
    state: dict[str, Any] | None = None,
    reserve: int = 0,
) -> dict[str, Any]:
    """The gateways' policy; with `redis_url`, shared through it as `state` adds to; with
    `reserve`, each replica keeps that many of its slots for the `tight` class."""
    pool = {
        "max_concurrency": 12,
        **({"reserve": {"tight": reserve}} if reserve else {}),
        "queue": {"max_depth": 64, "max_wait_s": 5},
        "timeouts": {"connect_s": 2, "first_token_s": 3, "read_s": 3, "total_s": 30},
        "health": {"interval_s": 1, "reconcile_interval_s": 0},
    }
    out: dict[str, Any] = {
        "models": {
            m: {
                "tokenizer": str(directory(m)),
                "max_model_len": MAX_MODEL_LEN,
                "tokenizer_backend": backend,
            }
            for m in MODELS
        },
        "pools": {
            m: {
                "model": m,
                "replicas": replicas[m],
                **pool,
                **({"max_output_tokens": OUTPUT_CAPS[m]} if m in OUTPUT_CAPS else {}),
                **({"slo": SLO[m]} if m in SLO else {}),
            }
            for m in MODELS
        },
        "classes": CLASSES,
        "routes": [
            {
                "match": {"model": [m]},
                "pool": m,
                **({"passthrough": ["/v1/adversary/echo"]} if m == MODELS[0] else {}),
            }
            for m in MODELS
        ],
        "server": {
            "metrics_port": metrics_port,
            "body_timeout_s": 10,
            "drain_grace_s": 1,
            "max_body_bytes": MAX_BODY_BYTES,
        },
        "admin": {"watch_interval_s": 0},
        "tenants": {
            name: {
                "keys": [f"sha256:{hashlib.sha256(key_of(name).encode()).hexdigest()}"],
                "tpm": tpm,
                "rpm": rpm,
                "tier": TIERS.get(name, "standard"),
                **({"slo": TENANT_SLO[name]} if name in TENANT_SLO else {}),
            }
            for name, (tpm, rpm) in TENANTS.items()
        },
    }
    if redis_url is not None:
        out["state"] = {
            "backend": "redis",
            "url": redis_url,
            "gateways": gateways,
            "on_failure": "open",
            "timeout_s": REDIS_TIMEOUT_S,
            "lease_ttl_s": 3,
            **(state or {}),
        }
    return out


@contextlib.asynccontextmanager
async def _served(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def live_leases(server: RedisServer) -> int:
    """Slot leases in Redis that have not expired: what S checks is back to none."""
    client = redis.Redis(port=server.port, socket_timeout=2)
    now = time.time()
    return sum(client.zcount(key, now, "+inf") for key in client.scan_iter("slots:*", count=1000))


def count_received(endpoint: str, raw: bytes, stream: bool) -> int:
    """Output tokens in what the client read: the text of complete delta events (a stream) or
    of the answer (whole). The Responses API repeats the text in its `.done` and `.completed`
    events, which are not counted again."""
    piece = PIECE.encode()
    if not stream:
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return 0
        if not isinstance(answer, dict):
            return 0
        return orjson.dumps(
            answer.get("choices")
            or answer.get("content")
            or answer.get("output")
            or answer.get("text")
            or []
        ).count(piece)
    marks = (
        b'"chat.completion.chunk"',
        b'"text_completion"',
        b"content_block_delta",
        b"response.output_text.delta",
        b'"transcription.chunk"',
    )
    events = raw.split(b"\n\n")[:-1]  # the last one may be cut
    return sum(e.count(piece) for e in events if any(m in e for m in marks))


async def leave_upload(url: str, p: Planned, outcome: Outcome) -> None:
    """A client that sends its upload's head (its whole length declared) and `leave_byte` of
    its body, then closes the connection."""
    assert p.upload is not None
    host, _, port = url.removeprefix("http://").partition(":")
    head = (
        f"POST {ENDPOINT_PATHS[p.endpoint]} HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {key_of(p.tenant)}\r\nx-request-id: {p.nonce}\r\n"
        f"Content-Type: {p.upload.content_type}\r\nContent-Length: {len(p.upload.raw)}\r\n\r\n"
    )
    try:
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(head.encode() + p.upload.raw[: p.leave_byte % max(1, len(p.upload.raw))])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
    except OSError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:200]
    outcome.left_early = True
    outcome.ended = time.time()


async def send(
    http: aiohttp.ClientSession, url: str, p: Planned, outcome: Outcome, previous: str | None
) -> None:
    if p.read == "leave_upload":
        await leave_upload(url, p, outcome)
        return
    headers = CIMultiDict({"Authorization": f"Bearer {key_of(p.tenant)}", "x-request-id": p.nonce})
    for name, value in p.headers:
        headers.add(name, value)
    body = dict(p.body)
    if previous is not None:
        body["previous_response_id"] = previous
    sent: dict[str, Any] = {"json": body}
    if p.upload is not None:
        headers["Content-Type"] = p.upload.content_type
        sent = {"data": p.upload.raw}
    raw = bytearray()
    try:
        async with http.post(f"{url}{ENDPOINT_PATHS[p.endpoint]}", headers=headers, **sent) as resp:
            outcome.status = resp.status
            outcome.retry_after = resp.headers.get("Retry-After")
            async for chunk in resp.content.iter_chunked(4096):
                raw += chunk
                if p.read == "leave" and len(raw) >= p.leave_byte:
                    outcome.left_early = True
                    resp.close()
                    break
                if p.read == "slow" and len(raw) < 1_000_000:
                    await asyncio.sleep(SLOW_READ_S)
    except (aiohttp.ClientError, TimeoutError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:200]
    outcome.ended = time.time()
    outcome.leaked = SECRET.encode() in raw
    if outcome.status >= 400:
        outcome.refusal = bytes(raw[:4096])
    outcome.received_tokens = count_received(p.endpoint, bytes(raw), p.stream)
    if p.endpoint == "responses" and outcome.status == 200 and not outcome.left_early:
        outcome.response_id = _response_id(bytes(raw), p.stream)


def _response_id(raw: bytes, stream: bool) -> str | None:
    if not stream:
        with contextlib.suppress(orjson.JSONDecodeError):
            return orjson.loads(raw).get("id")
        return None
    for event in raw.split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data: ") and b"response.completed" in line:
                with contextlib.suppress(orjson.JSONDecodeError):
                    return orjson.loads(line[6:]).get("response", {}).get("id")
    return None


async def _ticker(
    url: str, pids: list[int], into: list[tuple[float, float, float]]
) -> AsyncIterator[None]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loadtest.adversary.ticker",
        url,
        ",".join(map(str, pids)),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdin is not None

    async def read() -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            second, worst, unexplained = line.split()
            into.append((float(second), float(worst), float(unexplained)))

    reading = asyncio.create_task(read())
    try:
        yield
    finally:
        proc.stdin.close()
        try:
            async with asyncio.timeout(5):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()
        await reading


ticker = contextlib.asynccontextmanager(_ticker)


def _serving(policy: Path) -> list[int]:
    """The process ids serving `policy` (their command lines name it): a gateway, or a pod's
    parent and workers."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                if b"serve" in argv and str(policy).encode() in argv:
                    found.append(int(proc.name))
    return found


async def _all_serving(policy: Path, processes: int) -> list[int]:
    """`_serving(policy)` once all `processes` run: a pod's workers start after its parent."""
    async with asyncio.timeout(60):
        while len(pids := _serving(policy)) < processes:  # noqa: ASYNC110 - another process
            await asyncio.sleep(0.1)
    return pids


async def _scrape(http: aiohttp.ClientSession, port: int) -> str:
    try:
        async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"# scrape failed: {exc!r}\n"


LAG_S = 0.05  # the margin over the quiet baseline L allows, and the loop-lag histogram bucket read


def lags_over(metrics: str) -> float:
    """Observations of `llm_event_loop_lag_seconds` over LAG_S in a scrape."""
    for family in text_string_to_metric_families(metrics):
        if family.name == "llm_event_loop_lag_seconds":
            buckets: dict[str | None, float] = {}
            for s in family.samples:  # a pod's workers each have theirs
                if "le" in s.labels:
                    buckets[s.labels["le"]] = buckets.get(s.labels["le"], 0.0) + s.value
            return buckets.get("+Inf", 0.0) - buckets.get(str(LAG_S), 0.0)
    return 0.0


async def _watch_lags(run: Run, ports: list[int]) -> None:
    """Each gateway's loop-lag histogram read once a second through the attack: L's second
    witness, placed in time."""
    run.lags = [[] for _ in ports]
    seen = [-1.0] * len(ports)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while True:
            for i, port in enumerate(ports):
                over = lags_over(await _scrape(http, port))
                if seen[i] >= 0 and over > seen[i]:
                    run.lags[i].append((time.time(), over - seen[i]))
                seen[i] = over
            await asyncio.sleep(1.0)


async def _play(
    run: Run,
    plan: Plan,
    urls: list[str],
    redis_proc: RedisServer | None,
    link: SlowLink | None,
) -> None:
    limit = asyncio.Semaphore(CLIENT_CONCURRENCY)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    ids: dict[str, str | None] = {}
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:

        async def one(p: Planned) -> None:
            previous = None
            if p.after is not None:
                previous = ids.get(p.after)
                if previous is None:
                    return  # the turn it continues failed: nothing to chain
            async with limit:
                outcome = Outcome(p, time.time())
                run.outcomes.append(outcome)
                await send(http, urls[p.gateway], p, outcome, previous)
                ids[p.nonce] = outcome.response_id

        async def move(m: Move) -> None:
            await asyncio.sleep(max(0.0, run.started + m.at_s - time.time()))
            together = 0 if m.concurrent else len(m.requests)
            if m.burst_from is not None:
                together = m.burst_from
            for p in m.requests[:together]:
                await one(p)
            await asyncio.gather(*(one(p) for p in m.requests[together:]))

        async def outage() -> None:
            assert redis_proc is not None
            await asyncio.sleep(run.seconds * REDIS_DOWN[0])
            down = time.time()
            await asyncio.to_thread(redis_proc.stop)
            await asyncio.sleep(run.seconds * (REDIS_DOWN[1] - REDIS_DOWN[0]))
            await asyncio.to_thread(redis_proc.start)
            run.redis_down = (down, time.time())

        async def slow(held_s: float) -> None:
            assert link is not None
            await asyncio.sleep(run.seconds * REDIS_SLOW[0])
            began, link.delay_s = time.time(), held_s
            await asyncio.sleep(run.seconds * (REDIS_SLOW[1] - REDIS_SLOW[0]))
            link.delay_s = 0.0
            run.redis_slow = (began, time.time(), held_s)

        tasks = [asyncio.create_task(move(m)) for m in plan.moves]
        if redis_proc is not None:
            tasks.append(asyncio.create_task(outage()))
        if link is not None and (held_s := slow_replies(run.seed)):
            tasks.append(asyncio.create_task(slow(held_s)))
        done, pending = await asyncio.wait(tasks, timeout=run.seconds + DRAIN_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]


@functools.cache
def replica_counter(models: tuple[str, ...]) -> Counter:
    """The replica's count of `models`, loaded once a process: the seconds of tokenizer loading
    are the same for every run (the tests' several, `--until`'s many), and compete with the
    gateways' own start for the cores."""
    return Counter({m: directory(m) for m in models})


async def execute(
    seed: int, seconds: float, gateways: int, logs: Path, backend: str = "auto", workers: int = 1
) -> Run:
    """One run; its `Run` holds everything the checks read. `backend`: the gateways' tokenizer
    library (`tokenizers` starts three models in a third of the time of `auto`'s self-check);
    `workers`: each gateway a pod of that many (`serve --workers`), sharing Redis as two
    gateways do."""
    run = Run(seed, gateways, seconds, logs=logs, workers=workers)
    shared = gateways > 1 or workers > 1
    if shared:
        run.state, run.reserve = shared_state(seed), reserved_slots(seed)
    await asyncio.to_thread(logs.mkdir, parents=True, exist_ok=True)
    loading = asyncio.create_task(asyncio.to_thread(replica_counter, MODELS))
    replica = Replica(run.ledger, loading, MAX_MODEL_LEN)
    secret = web.Application()
    secret.router.add_route("*", "/{tail:.*}", lambda _: _secret_answer())
    redis_proc = RedisServer() if shared else None
    plan = Generator(seed, list(MODELS), list(TENANTS), gateways, slo_models=tuple(SLO)).plan(
        seconds
    )
    for m in plan.moves:
        for p in m.requests:
            run.ledger.scripts[p.nonce] = p.script
    try:
        async with contextlib.AsyncExitStack() as stack:
            run.ledger.secret_url = await stack.enter_async_context(_served(secret)) + "/leak"
            replicas = {
                m: [
                    await stack.enter_async_context(_served(replica.app()))
                    for _ in range(REPLICAS.get(m, 1))
                ]
                for m in MODELS
            }
            link, redis_url = None, None
            if redis_proc is not None:
                redis_proc.start()
                stack.callback(redis_proc.stop)
                link = SlowLink(redis_proc.port)
                redis_url = await stack.enter_async_context(link.serving())
            metrics_ports, starting = [], []
            for i in range(gateways):
                metrics_ports.append(free_port())
                directory_i = logs / f"gateway-{i}"
                directory_i.mkdir(exist_ok=True)
                path = directory_i / "policy.yaml"
                spec = policy(
                    replicas,
                    metrics_ports[-1],
                    redis_url,
                    gateways,
                    backend,
                    run.state,
                    run.reserve,
                )
                path.write_text(yaml.safe_dump(spec, sort_keys=False))
                starting.append(gateway_process(path, free_port(), directory_i, workers=workers))
            log(f"starting {gateways} gateway(s) and loading the replica's tokenizers")
            urls = await asyncio.gather(*(stack.enter_async_context(g) for g in starting))
            await loading
            for i, url in enumerate(urls):
                run.ticks.append([])
                pids = await _all_serving(
                    logs / f"gateway-{i}" / "policy.yaml", 1 + workers if workers > 1 else 1
                )
                await stack.enter_async_context(ticker(url, pids, run.ticks[-1]))
            log(f"{gateways} gateway(s) ready; quiet baseline {BASELINE_S:g} s")
            await asyncio.sleep(BASELINE_S)
            run.started = time.time()
            watching = asyncio.create_task(_watch_lags(run, metrics_ports))
            try:
                await _play(run, plan, urls, redis_proc, link)
            finally:
                watching.cancel()
            run.attack = (run.started, time.time())
            log(f"attack and drain took {run.attack[1] - run.attack[0]:.1f} s; quiet {QUIET_S:g} s")
            await asyncio.sleep(QUIET_S)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                run.metrics = [await _scrape(http, port) for port in metrics_ports]
            if redis_proc is not None:
                run.redis_leases = live_leases(redis_proc)
    finally:
        replica.close()
    log("stopped")
    for i in range(gateways):
        lines = (logs / f"gateway-{i}" / "access.jsonl").read_bytes().splitlines()
        for line in lines:
            with contextlib.suppress(orjson.JSONDecodeError):
                run.access.append({**orjson.loads(line), "gateway": i})
        text = (logs / f"gateway-{i}" / "gateway.log").read_text(errors="replace")
        run.asyncio_reports.append([x for x in text.splitlines() if " ERROR asyncio: " in x])
    return run


async def _secret_answer() -> web.Response:
    return web.Response(text=SECRET)
