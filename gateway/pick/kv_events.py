"""What a replica's engine says its prefix cache holds, from vLLM's own KV-cache events.

vLLM started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'` publishes, on a ZMQ PUB socket, one multipart message per engine
step that changed its cache: the topic, an 8-byte big-endian sequence number, and a msgpack
`KVEventBatch` — `[ts, events, data_parallel_rank]`, each event a map tagged by `type`:
`BlockStored` (`block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_name`,
`extra_keys`, `medium`, `group_idx`), `BlockRemoved` (`block_hashes`, `medium`, `group_idx`) or
`AllBlocksCleared` (vllm/distributed/kv_events.py, emitted by vllm/v1/core/block_pool.py).

The engine's block hashes depend on its hash algorithm and seed, which the gateway does not
share. So a block is keyed here by what it holds instead: the hash of its parent's key, its
token ids and its extra keys (the adapter's name on every block, the cache salt on the first,
as vllm/v1/core/kv_cache_utils.py `generate_block_hash_extra_keys` adds them), and the engine's
hash only maps to that key, for removals and for the next block's parent. A request's blocks,
made the same way from its own token ids (`token_blocks`), are then found exactly when the
replica holds them. Blocks of another medium (an offload tier), another KV-cache group, or a
block size other than the replica's are not indexed: no request is chunked that way.

What a replica publishes is not trusted to be vLLM's: the index keeps only block hashes of
vLLM's shapes (an int, or a digest of at most `MAX_HASH_BYTES`), so `capacity` bounds its
memory, and an event of any other shape is `invalid`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from gateway.pick.prefix_index import longest_prefix

ROOT = hash(("kv-events-root",))
PRIMARY_MEDIUM = "GPU"  # vLLM's name for the engine's own KV cache, whatever the device
MAX_HASH_BYTES = 64  # vLLM's block hashes are ints or digests (sha256: 32 bytes)


def _vllm_hash(value: Any) -> bool:
    return type(value) is int or (type(value) is bytes and len(value) <= MAX_HASH_BYTES)


def _frozen(value: Any) -> Any:
    """msgpack arrays decode as lists; a key must be hashable."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def block_extra(lora: str | None, salt: str | None, first: bool) -> tuple[Any, ...] | None:
    """A block's extra keys as the events publish them: the adapter's name, then (first block
    only) the cache salt; None when there are none."""
    keys = ((lora,) if lora else ()) + ((salt,) if first and salt else ())
    return keys or None


def chain_keys(parent: int, ids: Sequence[int], size: int, extras: Sequence[Any]) -> list[int]:
    """Keys of the blocks of `size` ids, as many as `extras` has entries (each block's extra
    keys), each hashed with its parent's key. The blocks are cut by `zip` over one iterator:
    measured, 0.6x the cost of slicing the ids into tuples, and a third of hashing them as bytes."""
    keys = []
    for chunk, extra in zip(zip(*[iter(ids)] * size), extras):  # noqa: B905 (the ids run on)
        parent = hash((parent, chunk, extra))
        keys.append(parent)
    return keys


def token_blocks(
    ids: Sequence[int], block_size: int, lora: str | None, salt: str | None, max_blocks: int
) -> tuple[int, ...]:
    """The keys of a prompt's full blocks of `block_size` tokens, each chained from the one
    before, as `EngineBlocks` keys what a replica stored."""
    count = min(len(ids) // block_size, max_blocks)
    if not count:
        return ()
    rest = block_extra(lora, salt, False)
    extras = [block_extra(lora, salt, True), *([rest] * (count - 1))]
    return tuple(chain_keys(ROOT, ids, block_size, extras))


class EngineBlocks:
    """The blocks one replica's engine holds, by content key; bounded, the oldest dropped."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.block_size: int | None = None  # the engine's, from its first full-block event
        self.seq: int | None = None  # the last batch's sequence number
        self._keys: OrderedDict[Any, int] = OrderedDict()  # engine hash -> content key
        self._held: dict[int, Any] = {}  # content key -> engine hash
        self.skipped = 0  # stored blocks not indexed: other medium, group or size, or no parent

    def __len__(self) -> int:
        return len(self._held)

    def matched(self, keys: Sequence[int]) -> int:
        """How many of `keys`, from the first, the engine holds: a binary search, since what
        an engine holds is closed under prefixes. vLLM frees a request's blocks tail first to
        the back of its eviction queue (`FreeKVCacheBlockQueue`), so a block's parent is
        evicted after it, and a hit is a run from the first block, so a child is never touched
        without its parent; this index drops its oldest first and stores an event's blocks
        leaf first for the same reason."""
        return longest_prefix(keys, self._held)

    def clear(self) -> None:
        self._keys.clear()
        self._held.clear()

    def apply(self, event: dict[str, Any]) -> str:
        """One event; returns its kind, "unknown", or "invalid" for a `BlockStored` whose block
        hashes are not vLLM's (kept, they would make each entry as large as the publisher
        likes). Raises TypeError for an event whose fields have the wrong types."""
        kind = event.get("type")
        if kind == "BlockStored":
            return self._stored(event)
        if kind == "BlockRemoved":
            self._removed(event)
        elif kind == "AllBlocksCleared":
            self.clear()
        else:
            return "unknown"
        return str(kind)

    def _primary(self, event: dict[str, Any]) -> bool:
        return event.get("medium") in (None, PRIMARY_MEDIUM) and event.get("group_idx") in (None, 0)

    def _stored(self, event: dict[str, Any]) -> str:
        hashes: list[Any] = event.get("block_hashes") or []
        tokens: list[int] = event.get("token_ids") or []
        size = event.get("block_size")
        if not isinstance(hashes, list) or not all(map(_vllm_hash, hashes)):
            return "invalid"
        if not hashes or not isinstance(size, int) or size <= 0 or not self._primary(event):
            self.skipped += len(hashes)
            return "BlockStored"
        if self.block_size is None:
            self.block_size = size
        parent_hash = event.get("parent_block_hash")
        parent = ROOT if parent_hash is None else self._keys.get(parent_hash)
        if size != self.block_size or len(tokens) != size * len(hashes) or parent is None:
            self.skipped += len(hashes)
            return "BlockStored"
        extras = [_frozen(e) for e in (event.get("extra_keys") or ())[: len(hashes)]]
        extras += [None] * (len(hashes) - len(extras))
        keys = chain_keys(parent, tokens, size, extras)
        for engine_hash, key in reversed(list(zip(hashes, keys, strict=True))):
            self._put(engine_hash, key)
        return "BlockStored"

    def _put(self, engine_hash: Any, key: int) -> None:
        old = self._keys.pop(engine_hash, None)
        if old is not None:
            self._held.pop(old, None)
        self._keys[engine_hash] = key
        self._held[key] = engine_hash
        while len(self._keys) > self.capacity:
            _, dropped = self._keys.popitem(last=False)
            self._held.pop(dropped, None)

    def _removed(self, event: dict[str, Any]) -> None:
        if not self._primary(event):
            return
        for engine_hash in event.get("block_hashes") or []:
            key = self._keys.pop(engine_hash, None)
            if key is not None:
                self._held.pop(key, None)
