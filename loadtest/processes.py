"""Child processes of the load tools: started, waited for, and always stopped.

A tool that starts the gateway (or a simulator) must not leave it running when it fails, nor
hang on a child that ignores SIGTERM: `python_process` terminates, waits a bounded time, then
kills. `gateway` adds the start-up wait on `/readyz`, bounded too, and says where the log is.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any

import aiohttp
import redis

STOP_WAIT_S = 10.0  # after SIGTERM, before SIGKILL
READY_WAIT_S = 180.0  # start-up (imports, tokenizers, DNS), at most: two gateways loading three
# real tokenizers each on a loaded 2-core machine took over 60 s


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A throwaway `redis-server` on a free loopback port, without persistence (a restart comes
    back empty, as a managed Redis may), that may be stopped and started again: the tests'
    shared state and the adversary's."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed: `apt-get install -y redis-server`"
                " (`make test` does, through tests/setup/tools.sh)"
            )
        self.binary, self.port = binary, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=1).ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


@contextlib.asynccontextmanager
async def python_process(
    *argv: str, stdout: int | IO[Any] | None = None, stderr: int | IO[Any] | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`python argv...` with this interpreter, stopped on the way out whatever happened."""
    proc = await asyncio.create_subprocess_exec(sys.executable, *argv, stdout=stdout, stderr=stderr)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it exited since the check
                proc.terminate()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STOP_WAIT_S):
                    await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@contextlib.asynccontextmanager
async def gateway(
    policy: Path, port: int, logs: Path, host: str = "127.0.0.1", workers: int = 1
) -> AsyncIterator[str]:
    """`python -m gateway serve` on `host:port` (`--workers N` with N > 1), ready; yields its
    URL. Its access log goes to `logs/access.jsonl`, its own log to `logs/gateway.log` (a pod's
    workers write theirs there too)."""
    url = f"http://{host}:{port}"
    log_path = logs / "gateway.log"
    with (logs / "access.jsonl").open("wb") as access, log_path.open("wb") as errors:
        argv: tuple[str, ...] = ("-m", "gateway", "serve", "--policy", str(policy), "--host", host)
        if workers > 1:
            argv += ("--workers", str(workers))
        async with python_process(*argv, "--port", str(port), stdout=access, stderr=errors) as proc:
            await _wait_ready(url, proc, log_path)
            yield url


async def _wait_ready(url: str, proc: asyncio.subprocess.Process, log: Path) -> None:
    timeout = aiohttp.ClientTimeout(total=5)
    with contextlib.suppress(TimeoutError):
        async with aiohttp.ClientSession(timeout=timeout) as http, asyncio.timeout(READY_WAIT_S):
            while proc.returncode is None:
                # aiohttp's own time-out is a plain TimeoutError: one slow answer is a retry too.
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(f"{url}/readyz") as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.1)
    state = "exited" if proc.returncode is not None else f"not ready in {READY_WAIT_S:g} s"
    raise RuntimeError(f"the gateway did not start ({state}); see {log}")
