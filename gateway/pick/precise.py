"""The `precise_prefix` scorer: the share of a request's leading token blocks each replica's
engine says it holds, from vLLM's KV-cache events (llm-d's "precise" mode).

Where `prefix` estimates a replica's cache from what this gateway sent it, this one is told:
every replica publishes what it stores and evicts (`kv_events.py`), so blocks that other
gateways sent, blocks evicted under memory pressure and a replica's restart all show. The price
is the prompt's token ids: the request's prompt is encoded whole (on the tokenizer's threads when
long), where counting alone is memoized per message (docs/benchmarks.md, "Prefix hashing").

Each replica is asked where it publishes (`GET /kv_event_sources`, vLLM's own endpoint: a `*`
host there is the replica's host), or the policy names the endpoint; one subscription per
replica follows it until the replica leaves, restarts or is ejected, when what it said is
forgotten. A gap in a publisher's sequence numbers (events dropped, or a restart) drops the
replica's blocks too: missed removals would otherwise leave blocks it no longer holds.

A feed is bounded whatever the replica sends, in time and memory alike. The subscription
speaks ZMQ's wire protocol itself (`zmtp`: libzmq's SUB socket holds a message of endless parts
whole, and stops following after refusing one too large): it reads one message at a time, of at
most three parts of `MAX_MESSAGE_BYTES` each (past that the kernel's buffers fill and the
publisher queues or drops), and ends the connection on any breach. A batch is not decoded
whole: its events are cut apart undecoded (`msgspec.Raw`, a skim of the bytes) and each is
decoded and applied on its own, one over `MAX_EVENT_BYTES` counted `oversize` and skipped, the
loop's other work let in every `SLICE_S`: so the loop is held at most for one skim or one
event's work, whatever the batch. The replica's index is bounded by `capacity_blocks` (and its
entries' size by `EngineBlocks`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import posixpath
import time
from collections import Counter
from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
from pydantic import Field, PositiveFloat, PositiveInt

from gateway.config.plugins import PluginError, register
from gateway.pick import zmtp
from gateway.pick.kv_events import EngineBlocks, token_blocks
from gateway.pick.scorers import Scorer, _Params
from gateway.upstream import replica_session

if TYPE_CHECKING:
    from gateway.admit import Claim, Replica
    from gateway.context.ctx import Ctx

log = logging.getLogger(__name__)

# One engine step's events: a 128k-token prefill in 16-token blocks is about 1 MB of msgpack.
# A bigger message part ends the connection before its body is read (`zmtp`).
MAX_MESSAGE_BYTES = 4 << 20
CONNECT_TIMEOUT_S = 5.0
# One request's blocks stored in one engine step: beyond any step vLLM takes, and at most what
# the loop is held for at once (decoding and applying are about equal shares of it).
MAX_EVENT_BYTES = 1 << 20
# Bytes do not bound the work: with 1-token blocks a byte can be a block. Work is per block
# (~3 us to key and index one) and per event, so those are bounded too, read from the arrays'
# headers before anything in them is decoded. A step of vLLM's stores at most its batch's
# tokens (`max_num_batched_tokens`, 8,192 by default) per request: 512 16-token blocks; a
# step's events are a few per request it runs (`max_num_seqs`, 256 by default).
MAX_EVENT_BLOCKS = 2048
MAX_BATCH_EVENTS = 4096
SLICE_S = 0.001  # events are applied this long at a time, then the loop's other work runs
MAX_RANKS = 1024  # data-parallel ranks per replica, each with its own sequence
_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")
_MAPS = frozenset(bytes([head]) for head in (*range(0x80, 0x90), 0xDE, 0xDF))  # msgpack map heads


class PreciseParams(_Params):
    endpoint: str | None = Field(
        None,
        description=(
            "Each replica's event endpoint, `{host}` (and `{port}`, its HTTP port) taken from"
            " its URL, e.g. `tcp://{host}:5557`; unset: asked of each replica at"
            " `/kv_event_sources`."
        ),
    )
    ipc_endpoints: list[str] = Field(
        [],
        description=(
            "The `ipc://` endpoints a replica's `/kv_event_sources` may name, as patterns"
            " (`ipc:///run/vllm/*`); one naming any other is not followed, as one that publishes"
            " nothing. An ipc endpoint is a socket on the gateway's own host: which one is the"
            " policy's to say, not a replica's. Empty: none."
        ),
    )
    max_blocks: PositiveInt = Field(
        1024, description="Token blocks looked up per request, from the prompt's first."
    )
    capacity_blocks: PositiveInt = Field(
        1 << 20,
        description=(
            "Blocks remembered per replica (about 200 bytes each), the oldest dropped first;"
            " at least what one replica's KV cache holds (`num_gpu_blocks`)."
        ),
    )
    retry_s: PositiveFloat = Field(
        5.0, description="Wait before asking a replica again where it publishes."
    )


def _ipc_allowed(endpoint: str, patterns: Sequence[str]) -> bool:
    """Whether `endpoint` (`ipc://...`) matches one of the policy's `patterns`, its path
    normalized (a `..` could climb out of a pattern's directory)."""
    path = endpoint[len("ipc://") :]
    return posixpath.normpath(path) == path and any(fnmatchcase(endpoint, p) for p in patterns)


def endpoints_of(url: str, sources: Any, ipc: Sequence[str] = ()) -> list[tuple[str, bytes]]:
    """The (endpoint, topic) of each engine a `/kv_event_sources` answer lists that a subscriber
    can connect to: a bound ZMQ publisher; a wildcard host becomes the replica's; an `ipc://`
    endpoint only if it matches one of the `ipc` patterns (`PreciseParams.ipc_endpoints`)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    found = []
    for config in sources.values() if isinstance(sources, dict) else ():
        if not isinstance(config, dict) or not config.get("enable_kv_cache_events"):
            continue
        endpoint = config.get("endpoint")
        if config.get("publisher") != "zmq" or not isinstance(endpoint, str):
            continue
        if endpoint.startswith("tcp://"):
            address, _, port = endpoint[len("tcp://") :].rpartition(":")
            if address not in _WILDCARD_HOSTS:
                continue  # it connects out, to a collector: nothing to subscribe to here
            endpoint = f"tcp://{host}:{port}"
        elif not (endpoint.startswith("ipc://") and _ipc_allowed(endpoint, ipc)):
            continue
        found.append((endpoint, str(config.get("topic") or "").encode()))
    return found


@functools.cache
def _batch_decoder() -> Any:
    """A decoder of vLLM's `KVEventBatch`, its events left undecoded (`msgspec.Raw`, one for
    all of them): a skim of the bytes that checks the shape and allocates nothing per event."""
    import msgspec

    batch = msgspec.defstruct(
        "KVEventBatch",
        # vLLM omits a rank of None, as vLLM before data parallelism did
        [
            ("ts", msgspec.Raw),
            ("events", msgspec.Raw),
            ("data_parallel_rank", int | None, None),
        ],
        array_like=True,
    )
    return msgspec.msgpack.Decoder(batch)


@functools.cache
def _blocks_decoder() -> Any:
    """A decoder of an event's `block_hashes` alone, undecoded: what its length is read from."""
    import msgspec

    shape = msgspec.defstruct("BlockHashes", [("block_hashes", msgspec.Raw, msgspec.Raw())])
    return msgspec.msgpack.Decoder(shape)


def array_length(raw: Any) -> int | None:
    """The length of the msgpack array `raw` (bytes, or a `msgspec.Raw`) from its header, or
    None if it is no array."""
    header = bytes(memoryview(raw)[:5])
    if not header:
        return None
    head = header[0]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head in (0xDC, 0xDD):
        width = 2 if head == 0xDC else 4
        return int.from_bytes(header[1 : 1 + width], "big") if len(header) > width else None
    return None


class ReplicaFeed:
    """Follows one replica's events into its `EngineBlocks`, until cancelled."""

    def __init__(
        self, url: str, blocks: EngineBlocks, scorer: PrecisePrefixScorer, retry_s: float
    ) -> None:
        self.url = url
        self.blocks = blocks
        self.scorer = scorer
        self.retry_s = retry_s
        self.task: asyncio.Task[None] | None = None
        import msgspec  # here, not at the top: kv-events' dependencies are optional

        self._batch_of = _batch_decoder().decode
        self._events = msgspec.msgpack.Decoder(list[msgspec.Raw]).decode
        self._hashes_of = _blocks_decoder().decode
        self._event = msgspec.msgpack.Decoder().decode
        self._refused = (ValueError, msgspec.DecodeError)

    async def run(self) -> None:
        """Ask where the replica publishes and follow it; asked again every `retry_s` while it
        publishes nothing or cannot be followed, or after its connection ended (its blocks
        dropped: what it said meanwhile is missed). Logged once, not at every retry: a replica
        started without the flag would otherwise log every few seconds for as long as it runs."""
        logged = False
        while True:
            problem, kinds = "publishes no KV-cache events", ["unavailable"]
            try:
                endpoints = await self.scorer.endpoints(self.url)
                if endpoints:
                    ended = await self._follow(endpoints)
                    self.blocks.clear()
                    problem, kinds = f"ended its event connection: {ended}", [ended.kind]
                    if ended.kind != "disconnected":
                        kinds.append("disconnected")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the replica is down, or answers nonsense: try later
                problem = f"cannot be followed ({type(exc).__name__})"
            for kind in kinds:
                self.scorer.count(self.url, kind)
            if not logged:
                log.info("kv events: replica %s %s; asking again every %gs",
                         self.url, problem, self.retry_s)  # fmt: skip
                logged = True
            await asyncio.sleep(self.retry_s)

    async def _follow(self, endpoints: list[tuple[str, bytes]]) -> zmtp.Ended:
        """Read every endpoint's batches until one's connection ends, and say why. A failure to
        connect is raised."""
        seqs: dict[int, int] = {}
        readers = [asyncio.create_task(self._read(e, topic, seqs)) for e, topic in endpoints]
        try:
            done, _ = await asyncio.wait(readers, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
        exc = next(iter(done)).exception()
        assert exc is not None  # a reader ends only by raising
        if isinstance(exc, zmtp.Ended):
            return exc
        raise exc

    async def _read(self, endpoint: str, topic: bytes, seqs: dict[int, int]) -> None:
        reader, writer = await zmtp.subscribe(endpoint, topic, CONNECT_TIMEOUT_S)
        try:
            async for frames in zmtp.messages(reader, MAX_MESSAGE_BYTES, 3):
                await self._batch(frames, seqs)
                await asyncio.sleep(0)  # a burst of batches yields between them
        finally:
            writer.close()

    async def _batch(self, frames: list[bytes], seqs: dict[int, int]) -> None:
        """One batch, `[topic, seq, [ts, events, rank]]`: its events cut apart undecoded, then
        each decoded and applied, `SLICE_S` at a time."""
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise ValueError("not vLLM's three parts")
            seq = int.from_bytes(frames[1], "big")
            batch = self._batch_of(frames[2])
            rank = batch.data_parallel_rank or 0
            if not 0 <= rank < MAX_RANKS:
                raise ValueError("not a data-parallel rank")
            count = array_length(batch.events)
            if count is None:
                raise ValueError("no array of events")
        except self._refused:
            self.scorer.count(self.url, "undecodable")
            return
        last = seqs.get(rank)
        seqs[rank] = seq
        if count > MAX_BATCH_EVENTS:  # its removals missed too: like a gap
            self.blocks.clear()
            self.scorer.count(self.url, "oversize_batch")
            return
        if last is not None and seq != last + 1:
            self.blocks.clear()  # dropped events, or a restart: what is left may be wrong
            self.scorer.count(self.url, "gap")
        await asyncio.sleep(0)  # the skim (of up to MAX_MESSAGE_BYTES) was this turn's work
        events = self._events(batch.events)  # at most MAX_BATCH_EVENTS, cut apart undecoded
        kinds: Counter[str] = Counter()
        began = time.perf_counter()
        for raw in events:
            if len(raw) > MAX_EVENT_BYTES or self._blocks(raw) > MAX_EVENT_BLOCKS:
                kinds["oversize"] += 1
                continue
            event = self._event(raw)  # valid msgpack: the skim above walked it
            try:
                kinds[self.blocks.apply(event) if isinstance(event, dict) else "unknown"] += 1
            except TypeError:  # fields of the wrong types
                kinds["invalid"] += 1
            if time.perf_counter() - began > SLICE_S:
                await asyncio.sleep(0)
                began = time.perf_counter()
        for kind, n in kinds.items():
            self.scorer.count(self.url, kind, n)

    def _blocks(self, raw: Any) -> int:
        """The blocks an event names, from its `block_hashes`' header (0 for any other event,
        or one whose hashes are no array: `apply` refuses that)."""
        if bytes(memoryview(raw)[:1]) not in _MAPS:
            return 0
        try:
            return array_length(self._hashes_of(raw).block_hashes) or 0
        except self._refused:  # keys that are not strings, say: `apply` sees to it
            return 0


@register("scorer", "precise_prefix")
class PrecisePrefixScorer(Scorer):
    """The share of the request's leading token blocks each replica's engine holds."""

    Params = PreciseParams
    part = "tokens"
    awaits = True  # the prompt's token ids come from the tokenizer's threads when it is long
    wants_token_ids = True

    def __init__(self, params: PreciseParams) -> None:
        try:
            import msgspec  # noqa: F401
        except ImportError:
            raise PluginError(
                "precise_prefix needs msgspec: pip install 'llm-admission-gateway[kv-events]'"
            ) from None
        self.params = params
        self.blocks: dict[str, EngineBlocks] = {}
        self.feeds: dict[str, ReplicaFeed] = {}
        self.events: Counter[tuple[str, str]] = Counter()  # (replica, kind) -> events
        self.blocks_sent = 0
        self.blocks_matched = 0
        self._http: aiohttp.ClientSession | None = None

    @property
    def block_size(self) -> int | None:
        return next((b.block_size for b in self.blocks.values() if b.block_size), None)

    async def prepare(self, ctx: Ctx) -> tuple[int, ...]:
        size = self.block_size
        if size is None or ctx.model is None:
            return ()  # no replica has told its block size yet: nothing could match
        ids = await ctx.api.prompt_ids(ctx.body, ctx.model.counter)
        if not ids:
            return ()
        salt = ctx.body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        return token_blocks(ids, size, ctx.adapter or None, salt, self.params.max_blocks)

    def follow(self, replicas: Sequence[Replica]) -> None:
        """Follow every replica of the pool, busy ones too: what a replica stores while it is
        too loaded to be picked still counts once it is not."""
        for replica in replicas:
            if replica.url not in self.feeds:
                self._follow(replica.url)

    def score(self, replicas: Sequence[Replica], claim: Claim, now: float) -> list[float]:
        keys = claim.affinity.tokens if claim.affinity is not None else ()
        if not keys:
            return [0.0] * len(replicas)
        return [self._matched(r.url, keys) / len(keys) for r in replicas]

    def _matched(self, url: str, keys: Sequence[int]) -> int:
        blocks = self.blocks.get(url)
        return blocks.matched(keys) if blocks is not None else 0

    def granted(self, replica: Replica, claim: Claim) -> None:
        if claim.affinity is not None and claim.affinity.tokens:
            self.blocks_sent += len(claim.affinity.tokens)
            self.blocks_matched += self._matched(replica.url, claim.affinity.tokens)

    def forget(self, url: str) -> None:
        feed = self.feeds.pop(url, None)
        if feed is not None and feed.task is not None:
            feed.task.cancel()
        self.blocks.pop(url, None)
        for key in [k for k in self.events if k[0] == url]:  # replicas come and go (DNS)
            del self.events[key]

    async def close(self) -> None:
        tasks = [f.task for f in self.feeds.values() if f.task is not None]
        for url in list(self.feeds):
            self.forget(url)
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    def count(self, url: str, kind: str, n: int = 1) -> None:
        self.events[(url, kind)] += n

    def _follow(self, url: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # picked outside a running gateway (a unit of the picker): nothing to follow
        blocks = self.blocks[url] = EngineBlocks(self.params.capacity_blocks)
        feed = self.feeds[url] = ReplicaFeed(url, blocks, self, self.params.retry_s)
        feed.task = loop.create_task(feed.run(), name=f"kv-events {url}")

    async def endpoints(self, url: str) -> list[tuple[str, bytes]]:
        template = self.params.endpoint
        if template is not None:
            parts = urlsplit(url)
            return [(template.format(host=parts.hostname, port=parts.port), b"")]
        if self._http is None:
            self._http = replica_session(timeout=aiohttp.ClientTimeout(total=5))
        async with self._http.get(f"{url}/kv_event_sources") as resp:
            resp.raise_for_status()
            sources = await resp.json(content_type=None)
        return endpoints_of(url, sources, self.params.ipc_endpoints)
