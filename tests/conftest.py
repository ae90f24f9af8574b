"""Real parts only: stub replicas and the gateway on ephemeral loopback ports, a real tokenizer."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
import yaml
from aiohttp import web

from gateway.policy.compile import load_policy
from gateway.runtime import Gateway
from gateway.server.app import GATEWAY, create_app, create_metrics_app
from gateway.tokenizer.backends import AUTO
from gateway.tokenizer.counters import HFCounter
from gateway.tokenizer.loaded import LoadedTokenizer, shared
from loadtest.processes import RedisServer
from loadtest.real_tokenizers import directory as real_directory
from loadtest.stub_backend import CONFIG, STATS, StubConfig, StubStats, create_stub_app
from loadtest.tiny_tokenizer import build


@dataclass(frozen=True)
class Pace:
    """What a ticker on the loop saw while some work ran."""

    elapsed: float  # from the work's start to its end
    worst: float  # the longest the ticker went without a turn: the longest the loop was held
    late: float  # how late its turns came, in all: the loop held, or the process not run

    @property
    def waited(self) -> float:
        """The part of `elapsed` spent waiting (on a timer, a peer, a thread) rather than on the
        machine's pace: a bound on it holds however busy the machine is."""
        return self.elapsed - self.late


async def paced(work: Awaitable[Any], tick_s: float) -> tuple[Any, Pace]:
    """`work`'s result, and what a ticker that sleeps `tick_s` saw while it ran."""
    done, worst, late = asyncio.Event(), 0.0, 0.0

    async def tick() -> None:
        nonlocal worst, late
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(tick_s)
            now = time.perf_counter()
            gap = now - last
            if gap > 2 * tick_s:  # not a timer's usual slack
                late += gap - tick_s
            worst, last = max(worst, gap), now

    ticking = asyncio.create_task(tick())
    await asyncio.sleep(tick_s)
    began = time.perf_counter()
    try:
        result = await work
    finally:
        elapsed = time.perf_counter() - began
        done.set()
        await ticking
    return result, Pace(elapsed, worst, late)


async def longest_loop_gap(work: Awaitable[Any], tick_s: float) -> tuple[Any, float]:
    """`work`'s result, and the longest the event loop went without running a ticker that
    sleeps `tick_s` while it ran: how long anything held the loop meanwhile."""
    result, pace = await paced(work, tick_s)
    return result, pace.worst


@functools.cache
def real_reference(model: str) -> Any:
    """transformers' tokenizer of a real model (loadtest/real_tokenizers.py), what the gateway's
    counts are compared with: loaded once for the session, whichever module asks first."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_directory(model)))


@functools.cache
def real_load(model: str) -> LoadedTokenizer:
    """A real model's tokenizer as the gateway loads it (`auto`), held for the session: a load
    lives only while a counter holds it (gateway/tokenizer/loaded.py), so each module's counter
    or policy naming the same directory would otherwise load it again, seconds each."""
    return shared(str(real_directory(model)), AUTO)


def real_counter(model: str) -> tuple[Any, HFCounter]:
    """A real model's reference tokenizer and the gateway's counter of it; skipped where the
    real tokenizers cannot be fetched."""
    try:
        path = real_directory(model)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    real_load(model)
    return real_reference(model), HFCounter.load(str(path))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("tokenizer") / "tiny")


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@dataclass
class Stub:
    url: str
    stats: StubStats
    config: StubConfig


@dataclass
class RunningGateway:
    url: str
    gateway: Gateway
    access_log: io.BytesIO
    metrics_url: str  # `server.metrics_port`'s app, served on its own port as `serve` does

    def inflight(self) -> int:
        return sum(r.inflight for s in self.gateway.slots.values() for r in s.replicas)

    def inflight_tokens(self) -> int:
        return sum(r.inflight_tokens for s in self.gateway.slots.values() for r in s.replicas)

    def waiting(self) -> int:
        return sum(s.waiting for s in self.gateway.slots.values())


@pytest.fixture
async def stub_factory() -> AsyncIterator[Callable[..., Awaitable[Stub]]]:
    runners: list[web.AppRunner] = []

    async def start(**config: Any) -> Stub:
        app = create_stub_app(StubConfig(**config))
        runner, url = await _serve(app)
        runners.append(runner)
        return Stub(url, app[STATS], app[CONFIG])

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def stub(stub_factory: Callable[..., Awaitable[Stub]]) -> Stub:
    return await stub_factory()


def write_policy(directory: Path, policy: dict[str, Any]) -> Path:
    path = directory / "policy.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    return path


def basic_policy(tokenizer: str | Path, replicas: list[str], **pool: Any) -> dict[str, Any]:
    """One model, one pool; `pool` overrides pool fields (max_concurrency, queue, ...)."""
    return {
        "models": {"tiny": {"tokenizer": str(tokenizer), "max_model_len": 8192}},
        "pools": {"main": {"model": "tiny", "replicas": replicas, "max_concurrency": 8, **pool}},
        "classes": [{"name": "any", "when": {}}],
        "routes": [{"match": {"model": ["tiny", "tiny-alias"]}, "pool": "main"}],
    }


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[Any]:
    """The tiny model's compiled policy, its pool on a port nothing serves: for what runs
    without a replica (parse, count, explain)."""
    directory = tmp_path_factory.mktemp("tiny-policy")
    policy = load_policy(
        write_policy(directory, basic_policy(tokenizer_dir, ["http://127.0.0.1:9"]))
    )
    yield policy
    policy.close()


@pytest.fixture
async def gateway_factory(
    tmp_path: Path,
) -> AsyncIterator[Callable[[dict[str, Any]], Awaitable[RunningGateway]]]:
    runners: list[web.AppRunner] = []

    async def start(policy: dict[str, Any]) -> RunningGateway:
        compiled = load_policy(write_policy(tmp_path, policy))
        log = io.BytesIO()
        app = create_app(compiled, access_log=log)
        runner, url = await _serve(app)
        metrics, metrics_url = await _serve(create_metrics_app(app))
        runners.extend((runner, metrics))
        return RunningGateway(url, app[GATEWAY], log, metrics_url)

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def eventually(predicate: Callable[[], bool], within_s: float = 5.0) -> None:
    """Poll (bounded) until `predicate()` holds, or fail."""
    async with asyncio.timeout(within_s):
        while not predicate():  # noqa: ASYNC110 - the state lives in another component
            await asyncio.sleep(0.02)


async def accounted(gw: RunningGateway, logged: int) -> None:
    """Wait until the access log has more than `logged` lines and every quota correction is
    applied. The accounting (the log line, then scheduling the correction) can run after the
    client has its answer, so `quotas.pending == 0` alone may hold before it was scheduled."""
    await eventually(
        lambda: gw.access_log.getvalue().count(b"\n") > logged and gw.gateway.quotas.pending == 0
    )


@contextlib.asynccontextmanager
async def serving(
    policy_path: Path, stdout: int = asyncio.subprocess.PIPE
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """`llm-gateway serve` in its own process, as an operator runs it; killed if still running."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--policy", str(policy_path), "--port", "0",
        stdout=stdout, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    drain: asyncio.Task[bytes] | None = None
    try:
        async with asyncio.timeout(60):
            while True:
                line = (await proc.stderr.readline()).decode()
                assert line, "gateway exited before listening"
                if match := re.search(r"listening on (https?://\S+)", line):
                    break
        drain = asyncio.create_task(proc.stderr.read())  # or a chatty gateway fills the pipe
        yield proc, match.group(1)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if drain is not None:
            await drain


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def replica_app() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """Serve a test's own handler as a replica on loopback, at `path` (chat completions unless
    named): a replica that misbehaves as the test needs. Returns its URL; stopped after the test."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler, path: str = "/v1/chat/completions") -> str:
        app = web.Application()
        app.router.add_post(path, handler)
        runner, url = await _serve(app)
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def fresh_redis(redis_server: RedisServer) -> Iterator[RedisServer]:
    """The module's server, empty, and running again after a test that stopped it."""
    if redis_server.process is None:
        redis_server.start()
    redis.Redis(port=redis_server.port).flushdb()
    yield redis_server
    if redis_server.process is None:
        redis_server.start()
