"""`llm-gateway serve --workers N`: N gateway processes accepting on one port, under a small parent.

Why processes and not more threads: fastokens lets go of the GIL while it encodes, but the rest of
a request (parsing, rendering the chat, the stages, the relay) is Python on the loop's thread, and
that, not the encode, is what a second core waits on (docs/benchmarks.md, "Workers: a pod that
uses its cores"). A process per core runs that Python in parallel.

Each worker is a whole gateway (`serve` with the hidden `--worker-index`) that binds the same port
with SO_REUSEPORT, so the kernel spreads connections over them. They share caps and quotas through
the policy's shared state (with `state.backend: memory` each would count alone, so N > 1 refuses to
start), and each is one more gateway there: its failover share is 1/(`state.gateways` x N).

The parent holds the port (`--port 0` is resolved once, for all), starts the workers, starts again
one that dies (logged, and counted in `llm_gateway_worker_restarts_total`), forwards SIGHUP, turns a
worker's `/admin/reload` into a SIGHUP to every worker (the worker sends it SIGUSR1), passes SIGTERM
on and waits while the workers drain, and serves `server.metrics_port`: one scrape of the whole pod
(gateway/exporter/workers.py) and a `/readyz` that is ready when every worker is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web
from prometheus_client.openmetrics import exposition as openmetrics

from gateway.config.load import PolicyError, load_spec
from gateway.exporter.workers import merged, parent_families
from gateway.policy.compile import reference_problems
from gateway.server.exposition import Families, exposition
from gateway.upstream import replica_session

log = logging.getLogger("gateway.workers")
RESTART_AFTER_S = 1.0  # between a worker's death and its new start: a crash loop stays slow
RESTART_MAX_S = 30.0  # the longest, for a restart that keeps dying before it serves
SCRAPE_TIMEOUT_S = 5.0  # a worker's `/metrics` or `/readyz`; one that hangs is left out
KILL_AFTER_S = 10.0  # past the workers' own drain, before the parent kills what is left
ORPHAN_CHECK_S = 1.0  # how often a worker looks whether its parent is still there


@dataclass(frozen=True, slots=True)
class WorkerRole:
    """What the parent tells a worker: which one it is, of how many, where its `/metrics` listens
    for the parent (a Unix socket: the metrics port is the parent's), and whether it replaces
    one that died (the others serve meanwhile: it opens no listener until it can serve)."""

    index: int
    count: int
    metrics_socket: str
    restarted: bool


def refusal(policy_path: str, workers: int) -> str | None:
    """Why the policy cannot run on `workers` processes, or None. Only what the file says: the
    rest (tokenizers) each worker finds as a gateway alone would."""
    spec = load_spec(policy_path, reference_problems).spec
    if workers > 1 and spec.state.backend == "memory":
        return (
            f"--workers {workers} needs shared state: with state.backend: memory every worker"
            " would keep its own caps and quotas. Set state.backend: redis, or run --workers 1."
        )
    if workers > 1 and spec.server.metrics_port is None:
        return (
            f"--workers {workers} needs server.metrics_port: the pod's one /metrics scrape (every"
            " worker's) is served there, as no single worker's public port can."
        )
    return None


async def watch_parent(stop: asyncio.Event) -> None:
    """A worker whose parent is gone (killed without passing SIGTERM on) drains and stops rather
    than hold the port for ever."""
    parent = os.getppid()
    # Polled: nothing in the standard library signals it (Linux' PR_SET_PDEATHSIG is a prctl).
    while os.getppid() == parent:  # noqa: ASYNC110
        await asyncio.sleep(ORPHAN_CHECK_S)
    log.error("the workers' parent %d is gone: stopping", parent)
    stop.set()


def ask_parent_to_reload() -> None:
    """After `/admin/reload` in a worker: the parent sends every worker SIGHUP, this one too (it
    reloads again, finding the policy unchanged)."""
    os.kill(os.getppid(), signal.SIGUSR1)


def _hold_port(host: str, port: int) -> socket.socket:
    """A bound, never listening SO_REUSEPORT socket on the API's port: it resolves `--port 0`
    once for every worker and keeps the port the pod's while a worker restarts."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    held = socket.socket(family, kind, proto)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    held.bind(address)
    return held


class Supervisor:
    """The parent of `count` workers serving `policy_path` on `host:port`."""

    def __init__(self, policy_path: str, host: str, port: int, count: int) -> None:
        self.policy_path = policy_path
        self.host = host
        self.port = port
        self.count = count
        self.restarts = 0
        self.exit_code = 0
        self._served = False  # every worker has been ready at once
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._stop = asyncio.Event()
        self._sockets = Path(tempfile.mkdtemp(prefix="llm-gateway-workers-"))

    def _socket(self, index: int) -> Path:
        return self._sockets / f"worker-{index}.sock"

    async def _start(self, index: int, restarted: bool) -> asyncio.subprocess.Process:
        path = self._socket(index)
        path.unlink(missing_ok=True)  # its presence says the worker came up
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--policy", self.policy_path,
            "--host", self.host, "--port", str(self.port), "--workers", str(self.count),
            "--worker-index", str(index), "--metrics-socket", str(path),
            *(["--worker-restarted"] if restarted else []),
        )  # fmt: skip
        self._procs[index] = proc
        log.info("worker %d started (pid %d)", index, proc.pid)
        if self._stop.is_set():  # stopping began while it started: it missed the SIGTERM
            proc.send_signal(signal.SIGTERM)
        return proc

    async def _keep(self, index: int) -> None:
        """Worker `index` for as long as the pod runs: started again whenever it dies. The pod
        stops only when a worker's first start dies before serving (a policy it cannot load:
        every start would fail alike); a restart that dies before serving (killed as it loads,
        a file briefly unreadable) is tried again, each time later, while the others serve."""
        restarted, wait_s = False, RESTART_AFTER_S
        while True:
            proc = await self._start(index, restarted)
            code = await proc.wait()
            if self._stop.is_set():
                return
            served = self._socket(index).exists()
            if not served and not restarted:
                log.error("worker %d exited with %d before serving: stopping the pod", index, code)
                self.exit_code = code or 1
                self._stop.set()
                return
            self.restarts += 1
            restarted = True
            wait_s = RESTART_AFTER_S if served else min(2 * wait_s, RESTART_MAX_S)
            log.error(
                "worker %d (pid %d) died with %d%s: starting it again in %g s",
                index, proc.pid, code, "" if served else " before serving", wait_s,
            )  # fmt: skip
            await asyncio.sleep(wait_s)
            if self._stop.is_set():
                return

    def _signal_all(self, sig: signal.Signals) -> None:
        """`sig` to every running worker; a reload's SIGHUP only to those serving: one still
        starting reads the policy file as it loads anyway, and SIGHUP before its handler is
        installed would kill it."""
        for index, proc in self._procs.items():
            if sig == signal.SIGHUP and not self._socket(index).exists():
                continue
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    async def _fetch(self, index: int, path: str) -> tuple[int, str] | None:
        """A worker's answer on its metrics socket, or None (restarting, or not answering)."""
        connector = aiohttp.UnixConnector(path=str(self._socket(index)))
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        headers = {"Accept": openmetrics.CONTENT_TYPE_LATEST}
        try:
            async with (
                replica_session(timeout=timeout, connector=connector) as session,
                session.get(f"http://worker{path}", headers=headers) as response,
            ):
                return response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def _metrics(self, request: web.Request) -> web.Response:
        answers = await asyncio.gather(*(self._fetch(i, "/metrics") for i in range(self.count)))
        scrapes = {str(i): a[1] for i, a in enumerate(answers) if a is not None and a[0] == 200}
        running = sum(p.returncode is None for p in self._procs.values())
        families = await asyncio.to_thread(merged, scrapes)  # parsing is as long as writing
        return await exposition(
            request, Families([*families, *parent_families(running, self.restarts)])
        )

    async def _readyz(self, request: web.Request) -> web.Response:
        """The pod's readiness (the chart's probe with N > 1: on the public port it would reach
        whichever worker took the connection, one still loading too). Until every worker has
        been ready at once: 200 when each is, else the first that is not, or 503 naming the
        worker that does not answer. After that, 200 while any worker is: one that restarts
        listens only once it serves, so clients reach the others meanwhile, and a draining pod's
        workers all say 503."""
        answers = await asyncio.gather(*(self._fetch(i, "/readyz") for i in range(self.count)))
        ready = [a for a in answers if a is not None and a[0] == 200]
        if len(ready) == self.count:
            self._served = True
        if self._served and ready:
            return web.Response(text=ready[0][1], content_type="application/json")
        index, answer = next((i, a) for i, a in enumerate(answers) if a is None or a[0] != 200)
        body = (
            answer[1]
            if answer is not None
            else orjson.dumps({"ready": False, "worker": index, "answering": False}).decode()
        )
        return web.Response(status=503, text=body, content_type="application/json")

    async def run(self) -> int:
        held = _hold_port(self.host, self.port)
        self.port = held.getsockname()[1]
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._signal_all, signal.SIGHUP)
        loop.add_signal_handler(signal.SIGUSR1, self._signal_all, signal.SIGHUP)
        spec = load_spec(self.policy_path, reference_problems).spec
        metrics = web.Application()
        metrics.router.add_get("/metrics", self._metrics)
        metrics.router.add_get("/readyz", self._readyz)
        runner = web.AppRunner(metrics, access_log=None)
        await runner.setup()
        keepers = [
            asyncio.create_task(self._keep(i), name=f"worker:{i}") for i in range(self.count)
        ]
        try:
            await web.TCPSite(runner, self.host, spec.server.metrics_port).start()
            log.info(
                "%d workers on port %d; the pod's metrics on http://%s:%s/metrics",
                self.count, self.port, self.host, spec.server.metrics_port,
            )  # fmt: skip
            await self._stop.wait()
            log.info("stopping: the workers drain")
            self._signal_all(signal.SIGTERM)
            drain_s = spec.server.readiness_delay_s + spec.server.drain_grace_s + KILL_AFTER_S
            waits = [p.wait() for p in self._procs.values()]
            _, late = await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=drain_s)
            if late:
                log.error("%d workers still running after %.0f s: killed", len(late), drain_s)
                self._signal_all(signal.SIGKILL)
            await asyncio.gather(*keepers)
        finally:
            for keeper in keepers:
                keeper.cancel()
            await runner.cleanup()
            held.close()
            shutil.rmtree(self._sockets, ignore_errors=True)
        log.info("stopped")
        return self.exit_code


def supervise(policy_path: str, host: str, port: int, count: int) -> int:
    """`serve --workers N` with N > 1: refuse what cannot run on N workers, else run them."""
    try:
        problem = refusal(policy_path, count)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    return asyncio.run(Supervisor(policy_path, host, port, count).run())
