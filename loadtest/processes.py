"""Child processes of the load tools: started, waited for, and always stopped.

A tool that starts the gateway (or a simulator) must not leave it running when it fails, nor
hang on a child that ignores SIGTERM: `python_process` terminates, waits a bounded time, then
kills. `gateway` adds the start-up wait on `/readyz`, bounded too, and says where the log is.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any

import aiohttp

STOP_WAIT_S = 10.0  # after SIGTERM, before SIGKILL
READY_WAIT_S = 60.0  # the gateway's start-up (imports, tokenizers, first DNS lookup), at most


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
    policy: Path, port: int, logs: Path, host: str = "127.0.0.1"
) -> AsyncIterator[str]:
    """`python -m gateway serve` on `host:port`, ready; yields its URL. Its access log goes to
    `logs/access.jsonl`, its own log to `logs/gateway.log`."""
    url = f"http://{host}:{port}"
    log_path = logs / "gateway.log"
    with (logs / "access.jsonl").open("wb") as access, log_path.open("wb") as errors:
        argv = ("-m", "gateway", "serve", "--policy", str(policy), "--host", host)
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
