"""vLLM's KV-cache events, published as vLLM 0.32 publishes them, for the `precise_prefix` scorer.

vLLM started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq"}'`
sends, on a ZMQ PUB socket, one multipart message per engine step that changed its prefix
cache: the topic, an 8-byte big-endian sequence number from 0, and a msgpack `KVEventBatch`,
`[ts, events, data_parallel_rank]` (vllm/distributed/kv_events.py, `ZmqEventPublisher`); the
events are made in vllm/v1/core/block_pool.py. `GET /kv_event_sources` tells where
(vllm/entrypoints/serve/instrumentator/basic.py). The events are plain maps here, with the
fields vLLM's msgspec structs keep under `omit_defaults`, so the bytes decode the same way.

What the simulator cannot say: blocks of generated tokens and prompts it has no ids for (it
does not know those tokens, so they are never published), sliding-window blocks (vLLM publishes
them under their own `group_idx`; consumers follow group 0) and replays (`replay_endpoint` is
refused). pyzmq and msgspec (the `kv-events` extra) are imported only when events are on.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

MEDIUM = "GPU"  # vLLM's name for the engine's own KV cache, whatever the device
GROUP = 0  # the global (full-attention) layers' KV-cache group
KIND = "full_attention"
RANK = 0  # one engine per replica: data-parallel rank 0


class KVEventsConfig(BaseModel):
    """vLLM's `--kv-events-config` (vllm/config/kv_events.py), with its defaults."""

    model_config = ConfigDict(extra="forbid")

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: "zmq" when enabled, as in vLLM
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # replay only: reported, unused
    hwm: int = 100_000
    max_queue_size: int = 100_000  # vLLM's queue to its publisher thread: reported, unused
    topic: str = ""

    @model_validator(mode="after")
    def _resolve(self) -> KVEventsConfig:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.replay_endpoint is not None:
            raise ValueError("the simulator serves no replays: leave replay_endpoint unset")
        return self

    @property
    def publishing(self) -> bool:
        """Whether vLLM would make a ZMQ publisher (`EventPublisherFactory.create`)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def block_stored(
    hashes: list[int], parent: int | None, token_ids: list[int], block_size: int
) -> dict[str, Any]:
    """A `BlockStored` for consecutive full blocks, the first chained from `parent`."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": None,  # adapters run as the base model here, so no block carries one
        "medium": MEDIUM,
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": GROUP,
        "kv_cache_spec_kind": KIND,
    }


def block_removed(block_hash: int) -> dict[str, Any]:
    """A `BlockRemoved`: vLLM sends one per hash the allocator evicts."""
    return {
        "type": "BlockRemoved",
        "block_hashes": [block_hash],
        "medium": MEDIUM,
        "group_idx": GROUP,
    }


def binds(endpoint: str) -> bool:
    """vLLM binds wildcard and ipc/inproc endpoints and connects to the rest (a collector)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """One replica's PUB socket; `publish` never waits (see below)."""

    def __init__(self, config: KVEventsConfig) -> None:
        import msgspec
        import zmq

        self._encode = msgspec.msgpack.Encoder().encode
        # The process-wide context: several replicas in one process share its I/O thread.
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(config.hwm)
        self._noblock = zmq.NOBLOCK
        endpoint = config.endpoint
        try:
            if binds(endpoint):
                self._socket.bind(endpoint)
                if endpoint.endswith(":0"):  # an ephemeral port: say which one it got
                    endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._socket.connect(endpoint)
        except zmq.ZMQError:
            self._socket.close(linger=0)
            raise
        self.config = config.model_copy(update={"endpoint": endpoint})
        self._topic = config.topic.encode()
        self._seq = itertools.count()

    def source(self) -> dict[str, Any]:
        """This publisher's entry in `/kv_event_sources`: vLLM's resolved config."""
        return self.config.model_dump()

    def publish(self, events: list[dict[str, Any]]) -> None:
        """One batch, stamped with wall time as vLLM stamps it.

        A PUB socket drops messages for a subscriber at its high-water mark instead of
        blocking; NOBLOCK makes sure the engine's event loop can never wait here either.
        """
        payload = self._encode((time.time(), events, RANK))
        seq = next(self._seq).to_bytes(8, "big")
        self._socket.send_multipart((self._topic, seq, payload), flags=self._noblock)

    def close(self) -> None:
        self._socket.close(linger=0)
