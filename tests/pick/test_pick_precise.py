"""The `precise_prefix` scorer: replicas' own KV-cache events, as vLLM publishes them on ZMQ,
steer requests to the replica whose engine holds their prompt's blocks.

The publishers here are real ZMQ PUB sockets sending what vLLM 0.32 sends (one msgpack
`[ts, events, rank]` per engine step, numbered); tests_vllm/test_kv_events.py follows real vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from transformers import AutoTokenizer

from gateway.admit import Claim, Replica
from gateway.config.load import PolicyError
from gateway.context.affinity import Affinity
from gateway.pick.kv_events import EngineBlocks, token_blocks
from gateway.pick.precise import (
    MAX_EVENT_BLOCKS,
    MAX_EVENT_BYTES,
    MAX_MESSAGE_BYTES,
    PreciseParams,
    PrecisePrefixScorer,
    endpoints_of,
)
from gateway.policy.compile import load_policy
from tests.conftest import (
    RunningGateway,
    Stub,
    _serve,
    basic_policy,
    eventually,
    longest_loop_gap,
    write_policy,
)
from tests.pick.test_pick import RULE_SETS, classify

BLOCK = 16


def stored(
    hashes: list[int], tokens: list[int], parent: int | None = None, **extra: Any
) -> dict[str, Any]:
    """A BlockStored event as vLLM's msgspec encoder writes it."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        **extra,
    }


def removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


def test_blocks_are_known_by_content_chained_from_their_parent() -> None:
    ids = list(range(1000, 1000 + 4 * BLOCK))
    engine = EngineBlocks(capacity=100)
    engine.apply(stored([11, 12], ids[: 2 * BLOCK]))  # one step stores two blocks
    engine.apply(stored([13], ids[2 * BLOCK : 3 * BLOCK], parent=12))  # the next, a child
    keys = token_blocks(ids, BLOCK, None, None, 1024)
    assert len(keys) == 4 and engine.matched(keys) == 3
    # The same tokens after another first block are other blocks: chained, as vLLM hashes them.
    other = token_blocks([7] * BLOCK + ids[BLOCK:], BLOCK, None, None, 1024)
    assert engine.matched(other) == 0
    engine.apply(removed([13]))  # evicted, tail first as vLLM evicts: the chain shortens
    assert engine.matched(keys) == 2
    engine.apply(removed([12]))
    assert engine.matched(keys) == 1
    engine.apply({"type": "AllBlocksCleared"})
    assert engine.matched(keys) == 0 and len(engine) == 0


def test_adapters_and_cache_salts_key_blocks_apart_as_vllms_extra_keys_do() -> None:
    ids = list(range(2 * BLOCK))
    engine = EngineBlocks(capacity=100)
    engine.apply(
        stored([1, 2], ids, lora_name="sql-lora", extra_keys=[["sql-lora", "s1"], ["sql-lora"]])
    )
    assert engine.matched(token_blocks(ids, BLOCK, "sql-lora", "s1", 9)) == 2
    assert engine.matched(token_blocks(ids, BLOCK, "sql-lora", None, 9)) == 0
    assert engine.matched(token_blocks(ids, BLOCK, None, None, 9)) == 0


def test_what_cannot_be_chained_or_is_not_the_engines_own_cache_is_not_indexed() -> None:
    ids = list(range(BLOCK))
    engine = EngineBlocks(capacity=100)
    engine.apply(stored([5], ids, parent=999))  # a parent never seen: events were missed
    engine.apply(stored([6], ids, medium="CPU"))  # an offload tier
    engine.apply(stored([7], ids, group_idx=1))  # another KV-cache group (sliding window)
    engine.apply(stored([8], ids[:8], block_size=8))  # not the engine's block size... yet
    assert len(engine) == 0 and engine.skipped == 4
    assert engine.block_size is None or engine.block_size == BLOCK


def test_the_index_is_bounded_the_oldest_blocks_dropped() -> None:
    engine = EngineBlocks(capacity=3)
    for n in range(5):
        engine.apply(stored([n], [n] * BLOCK))
    assert len(engine) == 3
    assert engine.matched(token_blocks([4] * BLOCK, BLOCK, None, None, 9)) == 1
    assert engine.matched(token_blocks([0] * BLOCK, BLOCK, None, None, 9)) == 0


def test_endpoints_are_vllms_bound_publishers_with_the_replicas_host() -> None:
    sources = {
        "0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"},
        "1": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///run/kv1"},
        "2": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://collector:5557"},
        "3": {"enable_kv_cache_events": False, "publisher": "null", "endpoint": "tcp://*:5558"},
    }  # fmt: skip
    assert endpoints_of("http://10.0.0.7:8000", sources, ["ipc:///run/kv*"]) == [
        ("tcp://10.0.0.7:5557", b"kv"),
        ("ipc:///run/kv1", b""),
    ]
    assert endpoints_of("http://10.0.0.7:8000", {}) == []
    assert endpoints_of("http://10.0.0.7:8000", ["not", "a", "map"]) == []


@pytest.mark.parametrize(
    ("endpoint", "patterns"),
    [
        ("ipc:///run/kv1", []),  # the policy allows none: a replica picks no socket of ours
        ("ipc:///var/run/docker.sock", ["ipc:///run/*"]),
        ("ipc:///run/../var/run/docker.sock", ["ipc:///run/*"]),
        ("ipc:///run/kv/../../tmp/other", ["ipc:///run/kv/*"]),
    ],
)
async def test_an_ipc_endpoint_the_policy_does_not_allow_is_not_followed(
    endpoint: str, patterns: list[str]
) -> None:
    """Asked of a replica on loopback by the scorer, as it asks every replica it follows."""
    sources = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}}

    async def kv_event_sources(request: web.Request) -> web.Response:
        return web.json_response(sources)

    app = web.Application()
    app.router.add_get("/kv_event_sources", kv_event_sources)
    runner, url = await _serve(app)
    allowing = {"ipc_endpoints": patterns} if patterns else {}  # none: the default
    scorer = PrecisePrefixScorer(PreciseParams(**allowing))
    try:
        assert await scorer.endpoints(url) == []
        allowed = PrecisePrefixScorer(PreciseParams(ipc_endpoints=[endpoint]))
        followed = [(endpoint, b"")] if ".." not in endpoint else []
        assert await allowed.endpoints(url) == followed
        await allowed.close()
    finally:
        await scorer.close()
        await runner.cleanup()


class Publisher:
    """One replica's vLLM event publisher: a bound PUB socket, batches numbered from 0."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str) -> None:
        self.socket = context.socket(zmq.PUB)
        self.socket.bind(endpoint)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)  # a `*` port: which
        self.seq = 0

    async def publish(self, *events: dict[str, Any], skip: int = 0) -> None:
        await self.send(batch(list(events)), skip=skip)

    async def send(self, payload: bytes, skip: int = 0) -> None:
        """An encoded batch, numbered next (after `skip` lost ones)."""
        self.seq += skip
        await self.socket.send_multipart([b"", self.seq.to_bytes(8, "big"), payload], copy=False)
        self.seq += 1


def batch(events: list[dict[str, Any]], rank: int = 0) -> bytes:
    return msgspec.msgpack.encode([time.time(), events, rank])


@pytest.fixture
async def zmq_context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def prompt_ids(tokenizer_dir: Path, body: dict[str, Any]) -> list[int]:
    """What vLLM encodes for a chat: the template rendered, then encoded without special tokens."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    text = tokenizer.apply_chat_template(
        body["messages"], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def blocks_of(ids: list[int], first_hash: int) -> dict[str, Any]:
    """The BlockStored a replica publishes after prefilling `ids` (its full blocks)."""
    full = len(ids) // BLOCK
    return stored(list(range(first_hash, first_hash + full)), ids[: full * BLOCK])


def precise_scorer(gateway: RunningGateway) -> PrecisePrefixScorer:
    scorer = gateway.gateway.slots["main"].picker.precise  # type: ignore[attr-defined]
    assert isinstance(scorer, PrecisePrefixScorer)
    return scorer


async def served_by(
    http: aiohttp.ClientSession, gateway: RunningGateway, stubs: list[Stub], body: dict[str, Any]
) -> int:
    async with http.post(f"{gateway.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
    content = body["messages"][0]["content"]
    return next(
        i
        for i, s in enumerate(stubs)
        if any(b["messages"][0]["content"] == content for b in s.stats.bodies)
    )


async def test_requests_go_where_the_engine_says_their_prefix_is_and_leave_when_it_is_evicted(
    tmp_path: Path,
    tokenizer_dir: Path,
    zmq_context: zmq.asyncio.Context,
    stub_factory: Callable[..., Awaitable[Stub]],
    gateway_factory: Callable[[dict[str, Any]], Awaitable[RunningGateway]],
    http: aiohttp.ClientSession,
) -> None:
    stubs = [await stub_factory() for _ in range(2)]
    endpoint = f"ipc://{tmp_path}/kv-{{port}}.ipc"
    publishers = [
        Publisher(zmq_context, endpoint.format(port=s.url.rsplit(":", 1)[1])) for s in stubs
    ]
    pick = {"scorers": {"precise_prefix": {"weight": 1, "endpoint": endpoint, "retry_s": 0.1}}}
    gateway = await gateway_factory(basic_policy(tokenizer_dir, [s.url for s in stubs], pick=pick))
    scorer = precise_scorer(gateway)
    await served_by(http, gateway, stubs, classify("warm-up", "nothing"))  # the feeds start
    # The second replica's engine prefilled rule set B (as if another gateway had sent it).
    b_ids = prompt_ids(tokenizer_dir, classify(RULE_SETS["B"], "lamp 0"))
    b_blocks = blocks_of(b_ids, 100)
    url_b = stubs[1].url

    async def announced() -> bool:
        await publishers[1].publish(b_blocks)  # a subscriber joins late: say it until heard
        await asyncio.sleep(0.05)
        return len(scorer.blocks.get(url_b) or ()) > 0

    for _ in range(100):
        if await announced():
            break
    else:
        raise AssertionError("the gateway never read the replica's events")
    for n in range(1, 4):
        assert await served_by(http, gateway, stubs, classify(RULE_SETS["B"], f"lamp {n}")) == 1
    assert await served_by(http, gateway, stubs, classify(RULE_SETS["C"], "lamp 1")) == 0  # a tie
    metrics = await (await http.get(f"{gateway.url}/metrics")).text()
    assert (
        f'llm_kv_event_blocks{{pool="main",replica="{url_b}"}} {len(b_ids) // BLOCK}.0' in metrics
    )
    assert 'llm_precise_prefix_blocks_total{outcome="matched",pool="main"}' in metrics
    # Evicted there: nothing holds it, and the tie goes to the first replica again.
    await publishers[1].publish(removed(b_blocks["block_hashes"][:1]))
    await eventually(lambda: len(scorer.blocks[url_b]) == len(b_blocks["block_hashes"]) - 1)
    assert await served_by(http, gateway, stubs, classify(RULE_SETS["B"], "lamp 9")) == 0


async def heard(
    publisher: Publisher, scorer: PrecisePrefixScorer, replica: Replica, n: int
) -> None:
    """Publish block `n` (`n` tokens of id `n`) until the scorer holds it: a subscriber joins
    late, and a PUB socket drops what is sent before it has."""
    claim = Claim(10, affinity=Affinity(tokens=token_blocks([n] * BLOCK, BLOCK, None, None, 9)))
    for _ in range(100):
        await publisher.publish(stored([n], [n] * BLOCK))
        await asyncio.sleep(0.05)
        if scorer.score([replica], claim, 0.0) == [1.0]:
            return
    raise AssertionError("the scorer never read the events")


@pytest.fixture
async def following(
    zmq_context: zmq.asyncio.Context,
) -> AsyncIterator[tuple[Publisher, PrecisePrefixScorer, Replica]]:
    """A replica's publisher on loopback TCP, and a scorer that has heard from it."""
    publisher = Publisher(zmq_context, "tcp://127.0.0.1:*")
    scorer = PrecisePrefixScorer(PreciseParams(endpoint=publisher.endpoint, retry_s=0.1))
    replica = Replica("http://127.0.0.1:9", 4, None)
    scorer.follow([replica])
    await heard(publisher, scorer, replica, 1)
    yield publisher, scorer, replica
    await scorer.close()


async def test_a_gap_in_the_sequence_drops_what_the_replica_said(
    tmp_path: Path, zmq_context: zmq.asyncio.Context
) -> None:
    endpoint = f"ipc://{tmp_path}/kv.ipc"
    publisher = Publisher(zmq_context, endpoint)
    scorer = PrecisePrefixScorer(PreciseParams(endpoint=endpoint, retry_s=0.1))
    replica = Replica("http://127.0.0.1:9", 4, None)
    claim = Claim(10, affinity=Affinity(tokens=token_blocks([1] * BLOCK, BLOCK, None, None, 9)))
    scorer.follow([replica])
    try:
        await heard(publisher, scorer, replica, 1)
        await publisher.publish(stored([2], [2] * BLOCK), skip=5)  # five batches lost
        await eventually(lambda: scorer.events[(replica.url, "gap")] == 1)
        assert scorer.score([replica], claim, 0.0) == [0.0]  # block 1 may be gone: not trusted
        assert len(scorer.blocks[replica.url]) == 1  # what came after the gap is kept
    finally:
        feeds = [f.task for f in scorer.feeds.values()]
        await scorer.close()
    assert all(task is not None and task.done() for task in feeds)


def filled(size: int, first_hash: int, oversize: int = 0) -> tuple[bytes, int]:
    """A batch of about `size` bytes of vLLM-shaped events (64 blocks each, a request's step,
    each chained to the one before), after one event of `oversize` bytes if asked; and the
    blocks of the vLLM-shaped ones."""
    events, n, parent = [], first_hash, None
    tokens = [70_000 + first_hash + i for i in range(64 * BLOCK)]  # ids of five bytes
    if oversize:
        events.append(stored([0], [70_000] * (oversize // 5 + 1)))
        assert len(batch(events)) > oversize
    while len(batch(events)) < size - 6_000:
        events.append(stored(list(range(n, n + 64)), tokens, parent=parent))
        parent, n = n + 63, n + 64
    return batch(events), n - first_hash


async def test_a_publisher_never_holds_the_event_loop_for_long_whatever_it_sends(
    following: tuple[Publisher, PrecisePrefixScorer, Replica],
) -> None:
    """Batches at the largest the feed takes, each with an event over the size one is decoded
    at: each batch's events are decoded and applied a slice at a time, the oversize one skipped
    undecoded and counted, so the loop is held a small part of what one batch costs at once
    (the whole batch decoded, then applied, in one go: as a batch was read before). Two rounds:
    a hold of the feed's shows in both, a pause of the machine's (it is shared) seldom does."""
    publisher, scorer, replica = following
    payloads = [
        filled(MAX_MESSAGE_BYTES, 1000 + i * 100_000, oversize=MAX_EVENT_BYTES + 1)
        for i in range(4)
    ]
    began = time.perf_counter()
    at_once = EngineBlocks(capacity=1 << 20)
    for event in msgspec.msgpack.decode(payloads[0][0])[1][1:]:
        at_once.apply(event)
    work_s = time.perf_counter() - began
    want = scorer.events[(replica.url, "BlockStored")]

    async def send(round_: list[tuple[bytes, int]]) -> None:
        nonlocal want
        want += sum(n // 64 for _, n in round_)
        for payload, _ in round_:
            await publisher.send(payload)
        await eventually(lambda: scorer.events[(replica.url, "BlockStored")] >= want, 20)

    worst = min(
        [(await longest_loop_gap(send(r), tick_s=0.001))[1] for r in (payloads[:2], payloads[2:])]
    )
    assert worst < work_s / 2, f"the loop was held {worst:.3f}s; one batch at once: {work_s:.3f}s"
    assert scorer.events[(replica.url, "oversize")] == len(payloads)
    assert len(scorer.blocks[replica.url]) == 1 + sum(blocks for _, blocks in payloads)


async def _held_while(scorer: PrecisePrefixScorer, url: str, kinds: tuple[str, ...], send) -> float:
    """The longest the loop went without a turn from `send` until one of `kinds` is counted."""
    before = sum(scorer.events[(url, kind)] for kind in kinds)

    async def sent_and_read() -> None:
        await send()
        await eventually(lambda: sum(scorer.events[(url, k)] for k in kinds) > before, 20)

    return (await longest_loop_gap(sent_and_read(), tick_s=0.001))[1]


async def test_an_event_of_tens_of_thousands_of_blocks_is_refused_by_its_blocks_not_bytes(
    following: tuple[Publisher, PrecisePrefixScorer, Replica],
) -> None:
    """With one-byte hashes and token ids a 16-token block is 18 bytes: an event within
    MAX_EVENT_BYTES names ~58,000 blocks, ~3 us each to key and index (with 1-token blocks a
    block is 3 bytes, and 6 times as many). Its blocks are counted from the array's header before
    anything in it is decoded."""
    publisher, scorer, replica = following
    n = (MAX_EVENT_BYTES - 1000) // (BLOCK + 2)  # a hash, its tokens, an extra key: a byte each
    event = stored([1] * n, [1] * (n * BLOCK))
    payload = batch([event])
    assert len(msgspec.msgpack.encode(event)) <= MAX_EVENT_BYTES and n > MAX_EVENT_BLOCKS
    # What keying and indexing it costs here, in the same run (a fixed bound measured the
    # machine's pace as well): the loop is held a small part of it. Two rounds: a pause of the
    # machine's seldom falls on both.
    began = time.perf_counter()
    EngineBlocks(capacity=1 << 20).apply(msgspec.msgpack.decode(msgspec.msgpack.encode(event)))
    work_s = time.perf_counter() - began

    gaps = [
        await _held_while(
            scorer, replica.url, ("oversize", "BlockStored"), lambda: publisher.send(payload)
        )
        for _ in range(2)
    ]
    assert min(gaps) < work_s / 4, f"the loop was held {gaps}; indexing it: {work_s:.3f}s"
    assert scorer.events[(replica.url, "oversize")] == 2


async def test_a_batch_of_millions_of_one_byte_events_is_refused_whole(
    following: tuple[Publisher, PrecisePrefixScorer, Replica],
) -> None:
    """A batch of ~4 million one-byte events cut apart held the loop for as long as that takes
    and ~220 MB while it lasted; its events are counted from the array's header, and past
    MAX_BATCH_EVENTS it is dropped as a gap is (its removals are lost with it). The hold is
    compared with cutting a quarter of them apart here, in the same run: a fixed bound measured
    the machine's pace as well. Two rounds: a pause of the machine's seldom falls on both."""
    publisher, scorer, replica = following
    events = [0] * (MAX_MESSAGE_BYTES - 64)
    payload = msgspec.msgpack.encode([time.time(), events, 0])
    assert len(payload) <= MAX_MESSAGE_BYTES
    quarter = msgspec.msgpack.encode(events[: len(events) // 4])
    began = time.perf_counter()
    msgspec.msgpack.Decoder(list[msgspec.Raw]).decode(quarter)
    quarter_s = time.perf_counter() - began

    gaps = [
        await _held_while(
            scorer, replica.url, ("oversize_batch", "unknown"), lambda: publisher.send(payload)
        )
        for _ in range(2)
    ]
    assert scorer.events[(replica.url, "oversize_batch")] == 2
    assert scorer.events[(replica.url, "unknown")] == 0  # none of its events was looked at
    assert len(scorer.blocks[replica.url]) == 0  # what the replica said before is dropped
    assert min(gaps) < quarter_s, f"the loop was held {gaps}; a quarter cut apart: {quarter_s}"


async def test_a_message_over_the_limit_costs_the_connection_and_the_feed_starts_over(
    following: tuple[Publisher, PrecisePrefixScorer, Replica],
) -> None:
    """Refused by its size before its body is read; the connection ends, the feed forgets what
    the replica said (it may miss what comes meanwhile) and connects again."""
    publisher, scorer, replica = following
    await publisher.send(b"x" * (MAX_MESSAGE_BYTES + 1))
    await eventually(lambda: scorer.events[(replica.url, "disconnected")] == 1)
    assert scorer.events[(replica.url, "oversize")] == 1
    assert len(scorer.blocks[replica.url]) == 0
    await heard(publisher, scorer, replica, 2)


async def test_what_is_not_vllms_shape_is_counted_and_not_kept(
    following: tuple[Publisher, PrecisePrefixScorer, Replica],
) -> None:
    """Block hashes as large as the publisher likes would make each of the index's entries so
    (it is bounded in entries); sequences per rank would grow with every rank named."""
    publisher, scorer, replica = following
    url = replica.url
    await publisher.publish(stored([b"h" * 4096], [3] * BLOCK))
    await publisher.publish(stored([4], [{"not": "a token"}] * BLOCK))
    await publisher.send(batch([stored([5], [5] * BLOCK)], rank=1 << 40))
    await publisher.socket.send_multipart([b"", b"\0" * 4096, batch([])])
    await eventually(lambda: scorer.events[(url, "undecodable")] == 2)
    await eventually(lambda: scorer.events[(url, "invalid")] == 2)
    assert len(scorer.blocks[url]) == 1  # block 1, from `following`


async def test_a_message_of_parts_without_end_is_not_held() -> None:
    """libzmq's SUB socket hands a message over only once its last part has arrived, however
    many parts, and a publisher that speaks ZMQ's wire protocol itself need never send that
    last part. This one sends 1 MiB parts for as long as it is let: the feed ends the connection
    at the fourth (vLLM sends three), and connects again."""
    greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
    ready = b"\x05READY\x0bSocket-Type" + (3).to_bytes(4, "big") + b"PUB"
    part = b"\x03" + (1 << 20).to_bytes(8, "big") + bytes(1 << 20)  # MORE, a long frame
    sent: list[int] = []

    async def publish(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(greeting + bytes([0x04, len(ready)]) + ready)
        parts = 0
        with contextlib.suppress(ConnectionError):
            await reader.readexactly(len(greeting))
            while True:
                writer.write(part)
                await writer.drain()
                parts += 1
        sent.append(parts)
        writer.close()

    server = await asyncio.start_server(publish, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    scorer = PrecisePrefixScorer(PreciseParams(endpoint=f"tcp://127.0.0.1:{port}", retry_s=0.1))
    replica = Replica("http://127.0.0.1:9", 4, None)
    scorer.follow([replica])
    try:
        # refused, and refused again once back; the publisher can see its connection end
        # before the feed counts why it ended it
        await eventually(
            lambda: (
                len(sent) >= 2
                and scorer.events[(replica.url, "undecodable")] >= 2
                and scorer.events[(replica.url, "disconnected")] >= 2
            )
        )
        assert max(sent) < 64  # what the sockets' buffers took before the feed let go
    finally:
        await scorer.close()
        server.close()
        await server.wait_closed()


def test_a_policy_refuses_precise_prefix_without_the_models_tokenizer(tmp_path: Path) -> None:
    policy = basic_policy(
        "estimate", ["http://127.0.0.1:9"], pick={"scorers": {"precise_prefix": 1}}
    )
    with pytest.raises(PolicyError, match=r"precise_prefix.*own tokenizer"):
        load_policy(write_policy(tmp_path, policy))


async def test_a_reload_that_changes_pick_stops_the_old_scorers_feeds(
    tmp_path: Path,
    tokenizer_dir: Path,
    stub_factory: Callable[..., Awaitable[Stub]],
    gateway_factory: Callable[[dict[str, Any]], Awaitable[RunningGateway]],
    http: aiohttp.ClientSession,
) -> None:
    stubs = [await stub_factory() for _ in range(2)]
    pick = {
        "scorers": {"precise_prefix": {"weight": 1, "endpoint": f"ipc://{tmp_path}/kv-{{port}}"}}
    }
    policy = basic_policy(tokenizer_dir, [s.url for s in stubs], pick=pick)
    gateway = await gateway_factory(policy)
    await served_by(http, gateway, stubs, classify("warm-up", "nothing"))
    old = precise_scorer(gateway)
    feeds = [f.task for f in old.feeds.values()]
    assert len(feeds) == 2 and not any(t is None or t.done() for t in feeds)
    policy["pools"]["main"]["pick"] = {"scorers": {"precise_prefix": 2, "queue": 1}}
    write_policy(tmp_path, policy)
    await gateway.gateway.reload()
    assert precise_scorer(gateway) is not old
    assert all(t is not None and t.done() for t in feeds) and not old.feeds
