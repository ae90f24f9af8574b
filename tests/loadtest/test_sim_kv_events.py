"""The simulator publishes vLLM's KV-cache events: a real replica on a loopback port, a real ZMQ
subscriber on an ipc endpoint, the fixture tokenizer, and the gateway's own event consumer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from transformers import AutoTokenizer

from gateway.pick.kv_events import EngineBlocks, token_blocks
from gateway.pick.precise import endpoints_of
from loadtest.sim import Profile, Replica, ReplicaOptions, start_replica
from loadtest.sim.kv_events import KVEventsConfig
from tests.loadtest.test_simulator import write_profile

BLOCK = 16
QUIET_S = 0.3  # no message this long after a response: the engine published nothing more
# The tiny model's weights take 570,368 bytes of HBM; each KV layer-block 2,048 bytes.
WEIGHTS_BYTES, LAYER_BLOCK_BYTES, LAYERS = 570_368, 2_048, 6

Message = tuple[bytes, int, list[Any]]  # topic, sequence number, [ts, events, rank]


def events_on(path: Path) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{path}")


@contextlib.asynccontextmanager
async def subscriber(endpoint: str, *, connected: bool = True) -> AsyncIterator[zmq.asyncio.Socket]:
    """A SUB socket on `endpoint`; with `connected`, only once its subscription can have reached
    the publisher (a PUB socket drops what it sends before that)."""
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.subscribe(b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(endpoint)
        if connected:
            await asyncio.wait_for(monitor.recv_multipart(), 5)
            await asyncio.sleep(0.1)  # the subscription follows the handshake
        yield sub
    finally:
        sub.disable_monitor()
        monitor.close()
        sub.close()
        context.term()


async def received(sub: zmq.asyncio.Socket, quiet_s: float = QUIET_S) -> list[Message]:
    """Every message until the publisher has been quiet for `quiet_s`."""
    out = []
    while True:
        try:
            topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), quiet_s)
        except TimeoutError:
            return out
        assert len(seq) == 8, "vLLM's sequence number: 8 bytes, big-endian"
        out.append((topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))


def events_of(messages: list[Message]) -> list[dict[str, Any]]:
    return [event for _, _, (_ts, events, _rank) in messages for event in events]


async def chat(http: aiohttp.ClientSession, replica: Replica, text: str) -> int:
    """One request of `text`, a token; its prompt's token count."""
    body = {"model": "tiny", "max_tokens": 1, "ignore_eos": True,
            "messages": [{"role": "user", "content": text}]}  # fmt: skip
    async with http.post(f"{replica.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        return int((await resp.json())["usage"]["prompt_tokens"])


def rendered_ids(tokenizer_dir: Path, text: str) -> list[int]:
    """The prompt's ids as vLLM computes them: the chat template rendered, then encoded."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def replica_factory() -> AsyncIterator[Any]:
    started: list[Replica] = []

    async def start(profile: Profile, options: ReplicaOptions) -> Replica:
        started.append(await start_replica(profile, options))
        return started[-1]

    yield start
    for replica in started:
        await replica.close()


LISTING = "review this listing: a lithium battery charger, " * 6
OTHER = "summary of the refund policy for children toy safety, " * 6


async def test_a_prompts_full_blocks_are_stored_once_chained_with_their_token_ids(
    tmp_path: Path, tokenizer_dir: Path, http: aiohttp.ClientSession, replica_factory: Any
) -> None:
    """The default tiny profile has sliding-window layers too: only the global blocks show."""
    config = events_on(tmp_path / "kv")
    options = ReplicaOptions(time_scale=1000, tokenizer=tokenizer_dir, kv_events_config=config)
    replica = await replica_factory(write_profile(tmp_path, serving={"block_size": BLOCK}), options)
    ids = rendered_ids(tokenizer_dir, LISTING)
    full = len(ids) // BLOCK
    assert full >= 4 and len(ids) % BLOCK, "several full blocks and a partial one"
    async with subscriber(config.endpoint) as sub:
        assert await chat(http, replica, LISTING) == len(ids)
        first = await received(sub)
        assert await chat(http, replica, LISTING) == len(ids)
        again = await received(sub)
    assert len(first) == 1, "one engine step changed the cache"
    topic, seq, (ts, events, rank) = first[0]
    assert (topic, seq, rank) == (b"", 0, 0) and isinstance(ts, float)
    [stored] = events
    assert stored["type"] == "BlockStored" and stored["block_size"] == BLOCK
    assert stored["token_ids"] == ids[: full * BLOCK]  # the partial block is never cached
    assert len(stored["block_hashes"]) == len(set(stored["block_hashes"])) == full
    assert stored["parent_block_hash"] is None  # block 0 has no parent
    assert (stored["medium"], stored["group_idx"], stored["extra_keys"]) == (
        "GPU",
        0,
        [None] * full,
    )
    assert again == [], "the repeated prompt hit its blocks: nothing was stored"
    # The gateway's consumer now knows the replica holds every full block of this prompt.
    blocks = EngineBlocks(1000)
    blocks.apply(stored)
    assert blocks.matched(token_blocks(ids, BLOCK, None, None, 100)) == full


async def test_evicted_blocks_are_removed_by_the_hashes_that_were_stored(
    tmp_path: Path, tokenizer_dir: Path, http: aiohttp.ClientSession, replica_factory: Any
) -> None:
    """Nine block positions (no sliding window): a second prompt evicts the first's blocks,
    tail first, and the consumer then finds only the first's head; sequence numbers run from 0."""
    positions = 9
    profile = write_profile(
        tmp_path,
        model={"sliding_window": None, "sliding_window_pattern": None},
        serving={"block_size": BLOCK, "max_model_len": 128},
        hardware={"hbm_bytes_per_chip": WEIGHTS_BYTES + positions * LAYERS * LAYER_BLOCK_BYTES},
    )
    config = events_on(tmp_path / "kv")
    options = ReplicaOptions(time_scale=1000, tokenizer=tokenizer_dir, kv_events_config=config)
    replica = await replica_factory(profile, options)
    listing, other = rendered_ids(tokenizer_dir, LISTING), rendered_ids(tokenizer_dir, OTHER)
    assert len(listing) // BLOCK + len(other) // BLOCK + 2 > positions, "both cannot stay cached"
    async with subscriber(config.endpoint) as sub:
        messages = []
        for text in (LISTING, LISTING, OTHER):
            await chat(http, replica, text)
            messages += await received(sub)
    assert [seq for _, seq, _ in messages] == list(range(len(messages)))
    events = events_of(messages)
    stored = {h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]}
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert removed and set(removed) <= stored and len(set(removed)) == len(removed)
    assert all(e["type"] in ("BlockStored", "BlockRemoved") for e in events)
    blocks = EngineBlocks(1000)
    for event in events:
        blocks.apply(event)
    listing_keys = token_blocks(listing, BLOCK, None, None, 100)
    other_keys = token_blocks(other, BLOCK, None, None, 100)
    assert blocks.matched(other_keys) == len(other_keys)  # the last prompt's blocks are held
    assert blocks.matched(listing_keys) == len(listing_keys) - len(removed)  # its tail went first


async def test_kv_event_sources_answers_as_vllm_does(
    tmp_path: Path, http: aiohttp.ClientSession, replica_factory: Any
) -> None:
    config = events_on(tmp_path / "kv")
    on = await replica_factory(write_profile(tmp_path), ReplicaOptions(kv_events_config=config))
    off = await replica_factory(write_profile(tmp_path), ReplicaOptions())
    async with http.get(f"{on.url}/kv_event_sources") as resp:
        sources = await resp.json()
    assert sources == {
        "0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": config.endpoint,
              "replay_endpoint": None, "buffer_steps": 10000, "hwm": 100000,
              "max_queue_size": 100000, "topic": ""},
    }  # fmt: skip
    # the scorer follows it, where the policy allows it
    assert endpoints_of(on.url, sources, [config.endpoint]) == [(config.endpoint, b"")]
    async with http.get(f"{off.url}/kv_event_sources") as resp:
        assert await resp.json() == {}  # vLLM's answer when its engine has no publisher


async def test_with_events_off_nothing_is_published(
    tmp_path: Path, tokenizer_dir: Path, http: aiohttp.ClientSession, replica_factory: Any
) -> None:
    """Not enabled, or enabled with vLLM's null publisher: no socket, no message, no source."""
    path = tmp_path / "kv"
    quiet = [
        None,
        KVEventsConfig(enable_kv_cache_events=True, publisher="null", endpoint=f"ipc://{path}"),
    ]
    async with subscriber(f"ipc://{path}", connected=False) as sub:
        for config in quiet:
            options = ReplicaOptions(
                time_scale=1000, tokenizer=tokenizer_dir, kv_events_config=config
            )
            replica = await replica_factory(write_profile(tmp_path), options)
            await chat(http, replica, LISTING)
            async with http.get(f"{replica.url}/kv_event_sources") as resp:
                assert await resp.json() == {}
            assert await received(sub) == []
    assert not path.exists(), "nothing bound the endpoint"


def test_replicas_of_one_process_get_their_own_endpoints() -> None:
    """As vLLM offsets a port per data-parallel rank; port 0 is the OS's pick for each."""
    from loadtest.sim.cli import replica_kv_events

    def endpoints(endpoint: str) -> list[str]:
        config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint)
        return [replica_kv_events(config, i).endpoint for i in range(3)]

    assert endpoints("tcp://*:5557") == ["tcp://*:5557", "tcp://*:5558", "tcp://*:5559"]
    assert endpoints("tcp://*:0") == ["tcp://*:0"] * 3
    assert endpoints("ipc:///run/kv") == ["ipc:///run/kv", "ipc:///run/kv_1", "ipc:///run/kv_2"]
