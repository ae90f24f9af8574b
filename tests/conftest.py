"""Real parts only: stub replicas and the gateway on ephemeral loopback ports, a real tokenizer."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from gateway.pipeline import Gateway
from gateway.policy.compile import load_policy
from gateway.server.app import GATEWAY, create_app
from loadtest.stub_backend import CONFIG, STATS, StubConfig, StubStats, create_stub_app
from loadtest.tiny_tokenizer import build


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
        runners.append(runner)
        return RunningGateway(url, app[GATEWAY], log)

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
