"""The running gateway as a process: its policy and live pools, reloads, and background tasks.

`Runtime` is one policy with the admission state serving it; a reload builds the next one and
swaps a single reference, so a request keeps the runtime it started with. `Gateway` owns what
outlives reloads (shared state, quotas, accounting, upstream sessions) and every background task:
health checks, DNS discovery, adapter lists, lease renewal, the policy-file watch, loop lag. The
request path is gateway/pipeline.py; it reads this, never the other way round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp

from gateway.admit import LivePool
from gateway.config.load import PolicyError, load_spec
from gateway.errors import ReloadFailed
from gateway.exporter import export
from gateway.fleet import adapters, discovery
from gateway.fleet.health import HealthChecker
from gateway.observability.instruments import Instruments
from gateway.observability.loop_lag import watch_lag
from gateway.observability.tracing import Tracing
from gateway.policy.compile import Policy, compile_policy, reference_problems
from gateway.request.account import Accountant
from gateway.request.holders import Holders
from gateway.request.quota import Quotas
from gateway.state import SlotLedger, State
from gateway.state.build import build_state
from gateway.tls import ListenerTls, replica_context
from gateway.tokenizer.counters import HFCounter
from gateway.upstream import Upstream, replica_session
from gateway.watched import stamp

log = logging.getLogger("gateway.runtime")
PASSIVE_WATCH_S = 5.0  # with watching off, how often to look whether a reload turned it on
RETIRE_WAIT_S = (
    1.0  # for a removed pool's health and adapter tasks to stop, before its session closes
)


@dataclass(frozen=True, slots=True)
class Runtime:
    """One policy and the admission state serving it. A reload builds the next one and swaps a
    single reference: a request keeps the runtime it started with, slots included."""

    policy: Policy
    slots: dict[str, LivePool]
    api_keys: dict[str, str | None]
    max_response_bytes: int  # server.max_response_bytes
    rename_model: bool  # server.response_model: requested
    upstreams: dict[str, Upstream]  # each pool's forwarding connections, kept while it is

    @classmethod
    def build(
        cls,
        policy: Policy,
        previous: Runtime | None,
        ledger: SlotLedger | None = None,
        spare_s: float = 0.0,
    ) -> Runtime:
        """`ledger` and `spare_s` (`state.spare_slots_s`) are the gateway's from its start: a
        changed `state` section takes effect at the next one, for new pools too."""
        slots = {}
        upstreams = {}
        for name, pool in policy.pools.items():
            carried = previous.upstreams.get(name) if previous is not None else None
            if carried is None:
                carried = Upstream(replica_context(pool.spec.tls_ca_file, _base(policy)))
            upstreams[name] = carried
            kept = previous.slots.get(name) if previous is not None else None
            if kept is None:
                slots[name] = LivePool(name, pool.spec, policy.pickers[name], ledger, spare_s)
            else:  # its replicas keep their counts: in-flight requests release where they took
                spec = pool.spec
                if spec.dns is not None:  # keep what DNS found until the next lookup
                    spec = spec.model_copy(update={"replicas": [r.url for r in kept.replicas]})
                kept.update(spec, policy.pickers[name])
                slots[name] = kept
        return cls(
            policy=policy,
            slots=slots,
            max_response_bytes=policy.spec.server.max_response_bytes,
            rename_model=policy.spec.server.response_model == "requested",
            upstreams=upstreams,
            api_keys={
                name: os.environ.get(pool.spec.api_key_env) if pool.spec.api_key_env else None
                for name, pool in policy.pools.items()
            },
        )


def _busy(slots: LivePool) -> bool:
    """Requests in flight on the pool or waiting in its queue."""
    return any(r.inflight for r in slots.replicas) or any(slots.waiting_by_tier)


def _pool_changes(before: Policy, after: Policy) -> str:
    """What a reload did to the pools, for its log line: the rest is in the file's diff."""
    old, new = before.pools, after.pools
    parts = [
        f"{word} {', '.join(sorted(names))}"
        for word, names in (
            ("added", new.keys() - old.keys()),
            ("removed", old.keys() - new.keys()),
            ("changed", {n for n in old.keys() & new.keys() if old[n].spec != new[n].spec}),
        )
        if names
    ]
    return "; ".join(parts) or "pools unchanged"


def _base(policy: Policy) -> Path:
    """What the policy's relative file names are relative to: its own directory."""
    return Path(policy.path).parent


def _warn_unscraped(policy: Policy, metrics_port: int | None) -> None:
    if metrics_port is None and policy.tenants:
        log.warning(
            "with tenants, /metrics (their names, their token counts, replica URLs) is not"
            " served on the public port: set server.metrics_port (read at start) to scrape it"
        )


def _tracing(policy: Policy, running: Tracing | None) -> Tracing | None:
    """The policy's tracing: the running one while its section is unchanged."""
    spec = policy.spec.tracing
    if spec is None:
        return None
    return running if running is not None and running.spec == spec else Tracing(spec)


class Gateway:
    """The running gateway: the current `Runtime`, upstream sessions, health checks, accounting."""

    def __init__(self, policy: Policy, access_log: IO[bytes] | None, workers: int = 1) -> None:
        # Outlives reloads: windows keep their charges and slots their leases (a changed
        # `state` section needs a restart).
        self.state: State
        self.ledger: SlotLedger | None
        self.state, self.ledger, holder_record = build_state(policy.spec.state, workers)
        self.workers = workers  # this process and the others of its pod (`serve --workers`)
        self.spare_s = policy.spec.state.spare_slots_s
        self.runtime = Runtime.build(policy, None, self.ledger, self.spare_s)
        for model in policy.models.values():  # built on the loop's thread, before it serves
            if isinstance(model.counter, HFCounter):
                model.counter.warm_inline()
        tls = policy.spec.server.tls  # the listener opens once: its context outlives reloads
        self.listener_tls = ListenerTls(tls, _base(policy)) if tls is not None else None
        self.metrics_port = policy.spec.server.metrics_port  # its listener, too, opens once
        _warn_unscraped(policy, self.metrics_port)
        self._tls_watch: asyncio.Task[None] | None = None
        self._retiring: dict[str, LivePool] = {}  # removed pools, for `retiring`
        self.reload_errors = 0
        instruments = Instruments()
        export(instruments.registry, lambda: self)  # read at each scrape, from the gateway built
        self.accountant = Accountant(instruments, access_log)
        self.quotas = Quotas(self.state, self.accountant.metrics)
        self.holders = Holders(policy.spec.server.max_stored_responses, holder_record)
        self.tracing = _tracing(policy, None)
        self.sessions: dict[str, aiohttp.ClientSession] = {}  # health, /metrics, adapters
        self.draining = False
        self._checkers: dict[str, asyncio.Task[None]] = {}
        self._discovery: dict[str, asyncio.Task[None]] = {}
        self._sharers: dict[str, asyncio.Task[None]] = {}
        self._adapters: dict[str, asyncio.Task[None]] = {}
        self._reload_lock = asyncio.Lock()
        self._closing = False
        self._stopping: set[asyncio.Task[None]] = set()  # what a reload left running
        self._watcher: asyncio.Task[None] | None = None
        self._lag: asyncio.Task[None] | None = None

    @property
    def policy(self) -> Policy:
        return self.runtime.policy

    @property
    def metrics_public(self) -> bool:
        """Whether the public port serves `/metrics` and names replicas in `/readyz`: only with
        no port of their own and no tenants (the running policy's), as the labels name tenants,
        their token counts and replica URLs; a gateway with tenants faces strangers."""
        return self.metrics_port is None and not self.policy.tenants

    @property
    def slots(self) -> dict[str, LivePool]:
        return self.runtime.slots

    @property
    def retiring(self) -> dict[str, LivePool]:
        """Pools a reload removed while requests were still in flight or queued on them, until
        those end (`_wind_down`): `/metrics` keeps their in-flight and queue gauges meanwhile.
        A name a later reload gave a new pool is that pool's."""
        return {n: s for n, s in self._retiring.items() if n not in self.runtime.slots and _busy(s)}

    def _serve_pools(self) -> list[asyncio.Task[None]]:
        """Sessions and health checks for every pool of the runtime; stop those of pools gone,
        and return their tasks."""
        for name, slots in self.runtime.slots.items():
            if name not in self.sessions:
                tls = self.runtime.upstreams[name].tls  # the pool's CA bundle, or the system's
                self.sessions[name] = replica_session(tls)
            if name not in self._checkers:
                checker = HealthChecker(slots, self.sessions[name])
                self._checkers[name] = asyncio.create_task(checker.run(), name=f"health:{name}")
            if slots.spec.dns is not None and (
                name not in self._discovery or self._discovery[name].done()
            ):
                self._discovery[name] = asyncio.create_task(
                    discovery.follow(slots), name=f"dns:{name}"
                )
            if name not in self._adapters:
                self._adapters[name] = asyncio.create_task(
                    adapters.follow(slots, self.sessions[name], lambda: self.policy.adapters),
                    name=f"adapters:{name}",
                )
            if self.ledger is not None and name not in self._sharers:
                self._sharers[name] = asyncio.create_task(self._share(slots), name=f"share:{name}")
        stopped = []
        for tasks in (self._sharers, self._checkers, self._discovery, self._adapters):
            for name in [n for n in tasks if n not in self.runtime.slots]:
                stopped.append(tasks.pop(name))
                stopped[-1].cancel()
        return stopped

    async def _retire(self, previous: Runtime, stopped: list[asyncio.Task[None]]) -> None:
        """Close what only the pools a reload removed used: their forwarding connections (a
        request still in flight keeps its own until it ends) and, once the tasks using them have
        stopped, their sessions."""
        gone = [name for name in previous.slots if name not in self.runtime.slots]
        for name in gone:
            previous.upstreams[name].close()
            self._retiring[name] = slots = previous.slots[name]
            self._in_background(self._wind_down(slots), f"retire:{name}")
        if stopped:
            _, pending = await asyncio.wait(stopped, timeout=RETIRE_WAIT_S)
            self._stopping |= pending  # one that swallowed its cancellation: `close` waits on it
            for task in pending:
                task.add_done_callback(self._stopping.discard)
        for name in gone:
            session = self.sessions.pop(name, None)
            if session is not None:
                await session.close()

    def _in_background(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """What a reload leaves running after it returns; `close` waits on what is left."""
        task = asyncio.create_task(work, name=name)
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def _wind_down(self, slots: LivePool) -> None:
        """A removed pool until its last request ends: its leases still renewed (with shared
        state; a stream outlives a lease), then the pool closed so its releases reach the
        ledger. `close` closes those still winding down."""
        every_s = min(1.0, self.policy.spec.state.lease_ttl_s / 3)
        while _busy(slots):
            await asyncio.sleep(every_s)
            try:
                await slots.share()
            except Exception:  # as `_share`: never lose the renewals to one bad tick
                log.exception("pool %s (removed): sharing its slots failed", slots.name)
        if self._retiring.get(slots.name) is slots:
            del self._retiring[slots.name]
        await slots.close()

    async def _share(self, slots: LivePool) -> None:
        """Renew the pool's leases three times per lease life (at least every second, so
        saturation agrees across gateways): a gateway that dies stops, and its leases expire."""
        every_s = min(1.0, self.policy.spec.state.lease_ttl_s / 3)
        # Not `while True`: a cancellation can be lost inside the Redis calls (seen in the test
        # suite: the loop went on renewing after `close` cancelled it, and `close` waited on it
        # for ever); the flag, or its pool leaving the runtime, ends it within one period
        # whatever the libraries did.
        while not self._closing and self.runtime.slots.get(slots.name) is slots:
            await asyncio.sleep(every_s)
            try:
                await slots.share()
            except Exception:  # never lose the renewals to one bad tick
                log.exception("pool %s: sharing its slots failed", slots.name)

    async def open(self) -> None:
        # Pools found by DNS start with what their name resolves to, not empty.
        await asyncio.gather(*(discovery.refresh(s) for s in self.runtime.slots.values()))
        self._serve_pools()
        # Probe before reporting: `/readyz` then says what the replicas answered, not a guess
        # (a probe's timeout at most; a refused connection fails at once).
        await asyncio.gather(*(slots.probed.wait() for slots in self.runtime.slots.values()))
        self._watcher = asyncio.create_task(self._watch(), name="policy-watch")
        self._lag = asyncio.create_task(
            watch_lag(self.accountant.metrics.loop_lag), name="loop-lag"
        )
        if self.listener_tls is not None:
            self._tls_watch = asyncio.create_task(self._watch_tls(), name="tls-watch")

    @property
    def tls_reload_errors(self) -> int:
        return self.listener_tls.reload_errors if self.listener_tls is not None else 0

    async def _watch_tls(self) -> None:
        """Load a renewed certificate when its files change (`gateway/tls.py`)."""
        assert self.listener_tls is not None
        while True:
            await asyncio.sleep(self.policy.spec.admin.watch_interval_s or PASSIVE_WATCH_S)
            await self.listener_tls.refresh(self.policy.spec.server.tls, _base(self.policy))

    async def _watch(self) -> None:
        """Reload when the policy file changes: rewritten, or another file behind its path (a
        mounted ConfigMap's update swaps the kubelet's `..data` symlink; `gateway/watched.py`)."""

        seen = stamp(self.policy.path)
        while True:
            await asyncio.sleep(self.policy.spec.admin.watch_interval_s or PASSIVE_WATCH_S)
            if not self.policy.spec.admin.watch_interval_s:
                continue
            now = stamp(self.policy.path)  # None mid-swap, or gone: keep the running policy
            if now is not None and now != seen:
                seen = now
                with contextlib.suppress(PolicyError, ReloadFailed):  # logged and counted
                    await self.reload()

    async def reload(self) -> Policy:
        """Validate the policy file and swap it in; raise `PolicyError`, keeping the running one,
        or `ReloadFailed` for anything else that went wrong. Either is counted and logged.

        Compiling (tokenizers, YAML) runs in a thread so requests keep flowing meanwhile.
        """
        async with self._reload_lock:
            current = self.runtime.policy
            if self._closing:  # `close` holds the lock next: nothing new may start
                return current
            try:
                return await self._reload(current)
            except PolicyError as exc:
                self.reload_errors += 1
                log.error("policy reload refused, the running policy stays:\n%s", exc)
                raise
            except Exception as exc:  # whatever it was, the watcher and `/admin/reload` go on
                self.reload_errors += 1
                log.exception("policy reload failed")
                raise ReloadFailed(
                    f"reloading {current.path} failed ({type(exc).__name__}: {exc});"
                    " see the gateway log"
                ) from exc

    async def _reload(self, current: Policy) -> Policy:
        """`reload` under its lock: compile the file, and swap it in if it changed."""
        policy = await asyncio.to_thread(
            lambda: compile_policy(
                load_spec(current.path, reference_problems), previous=current, share=self.workers
            )
        )
        if policy.digest != current.digest:
            if (policy.spec.server.tls is None) != (self.listener_tls is None):
                log.warning("server.tls turned on or off: the listener changes at the next start")
            if policy.spec.server.metrics_port != self.metrics_port:
                log.warning("server.metrics_port changed: its listener moves at the next start")
            _warn_unscraped(policy, self.metrics_port)
            previous = self.runtime
            self.runtime = Runtime.build(policy, previous, self.ledger, self.spare_s)
            self.holders.capacity = policy.spec.server.max_stored_responses
            tracing = _tracing(policy, self.tracing)
            if tracing is not self.tracing and self.tracing is not None:
                self._in_background(self.tracing.close(), "tracing-close")  # not under the lock
            self.tracing = tracing
            await self._retire(previous, self._serve_pools())
            kept = {id(picker) for picker in policy.pickers.values()}
            retired = {id(p): p for p in current.pickers.values()}
            await asyncio.gather(*(p.close() for key, p in retired.items() if key not in kept))
            log.info("policy %s reloaded: %s -> %s (%s)", policy.path, current.digest,
                     policy.digest, _pool_changes(current, policy))  # fmt: skip
        else:
            log.info("policy %s reloaded: unchanged (%s)", policy.path, policy.digest)
        return policy

    async def close(self) -> None:
        self._closing = True
        async with self._reload_lock:  # a reload under way ends first; later ones do nothing
            await self._close()

    async def _close(self) -> None:
        tasks = [
            *self._stopping,
            *self._checkers.values(),
            *self._discovery.values(),
            *self._sharers.values(),
            *self._adapters.values(),
            *([self._watcher] if self._watcher else []),
            *([self._lag] if self._lag else []),
            *([self._tls_watch] if self._tls_watch else []),
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._checkers.clear()
        closing = [*self.runtime.slots.values(), *self._retiring.values()]
        await asyncio.gather(*(slots.close() for slots in closing))
        for session in list(self.sessions.values()):
            await session.close()
        for upstream in self.runtime.upstreams.values():
            upstream.close()
        await self.quotas.close()
        await self.state.close()
        if self.tracing is not None:
            await self.tracing.close()
        self.policy.close()
        self.accountant.flush()
