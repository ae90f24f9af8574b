"""The KV cache as vLLM V1 manages it: a block pool with automatic prefix caching.

Mirrors, for the simulator's two kinds of layers (global and sliding-window), what
`vllm/v1/core/block_pool.py`, `kv_cache_manager.py`, `kv_cache_coordinator.py`
(`HybridKVCacheCoordinator`) and `single_type_kv_cache_manager.py` do:

- a block is one token-block position of one kind of layer; it weighs that kind's layer count
  in layer-blocks (`CacheGeometry`), because vLLM's hybrid allocator gives every group of a kind
  a block at the same positions at the same time;
- a full block gets a hash chained from its parent's (`kv_cache_utils.hash_block_tokens`) when
  it is allocated for the tokens that fill it, and stays findable by that hash until the
  allocator reuses it; partial blocks are never cached;
- a freed block goes back to the pool: an uncached one is reused first, a cached one joins the
  tail of an LRU queue (`FreeKVCacheBlockQueue`; a request frees its blocks tail first, so the
  tail of a chain is evicted before its head) and loses its hash only when the allocator takes
  it (`BlockPool.get_new_blocks` -> `_maybe_evict_cached_block`); a hit on a free cached block
  takes it out of the queue (`BlockPool.touch`); blocks are reference-counted, so requests
  share them;
- a lookup (`find_longest_cache_hit`) takes the longest run of cached global blocks from the
  start (`FullAttentionManager`), then, within it, the rightmost run of `ceil((window - 1) /
  block_size)` cached local blocks (`SlidingWindowManager`: a sliding-window layer needs only
  the window before the hit); the hit is the shorter of the two, at most `num_tokens - 1`
  tokens so the last token is always recomputed (`KVCacheManager.get_computed_blocks`);
- local blocks that left the window of a sequence's next token are freed (with their hash) as
  the sequence advances (`SingleTypeKVCacheManager.remove_skipped_blocks`).

Units are layer-blocks, as in `CacheGeometry`; `free_units` counts cached free blocks as free,
as vLLM's `kv_cache_usage_perc` does.

With `events` a list, the cache records vLLM's KV-cache events (`kv_events.py`) as
`BlockPool.cache_full_blocks` and `_maybe_evict_cached_block` make them, for global blocks
whose content is known (the prompt's full blocks): a `BlockStored` for each run of such blocks
whose hash was not cached yet, and a `BlockRemoved` when a published hash leaves the cache. A
block cached again while its twin is (vLLM publishes each copy) is not published: consumers
key blocks by content, and the hash stays cached until the last copy goes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from loadtest.sim.kv_events import block_removed, block_stored
from loadtest.sim.profiles import CacheGeometry
from loadtest.sim.sequence import Block, Sequence


class KVCache:
    """The block pool and the prefix cache of one simulated replica."""

    def __init__(self, geometry: CacheGeometry, *, enable_prefix_caching: bool = True) -> None:
        self.geometry = geometry
        self.block_size = geometry.block_size
        self.window = geometry.window if geometry.local_layers else 0
        self.global_weight = geometry.global_layers
        self.local_weight = geometry.local_layers
        self.caching = enable_prefix_caching
        self.capacity_units = geometry.capacity_units
        self._plain = geometry.capacity_units  # free units holding no cached block
        self._lru: OrderedDict[Block, None] = OrderedDict()  # free cached blocks, LRU first
        self._lru_units = 0
        self._cached: tuple[dict[int, Block], dict[int, Block]] = ({}, {})  # global, local
        self._twins: dict[tuple[int, int], list[Block]] = {}  # later blocks with a cached hash
        # Local blocks shared by several sequences: a decode span must not count one freed
        # by each holder as freed several times (see `shared_local_frees`).
        self.shared_local = 0
        # Blocks a sliding-window hit needs before its end (vLLM's contiguous-run rule).
        self.local_run = -(-(self.window - 1) // self.block_size) if self.window else 0
        # KV-cache events since the engine last published them; None: not recorded at all.
        self.events: list[dict[str, Any]] | None = None
        self._published: set[int] = set()  # cached global hashes a BlockStored announced

    @property
    def free_units(self) -> int:
        return self._plain + self._lru_units

    # -- hashes -----------------------------------------------------------------------------

    def block_hash(self, seq: Sequence, index: int) -> int:
        """Block `index`'s hash, chained from its parent's; computed once per block.

        A block wholly inside known prompt ids hashes its ids, so identical prefixes share
        hashes; any other block (generated tokens, or a prompt without ids) hashes the
        sequence's own id: only that sequence, after a preemption, can hit it.
        """
        hashes, bs, ids = seq.hashes, self.block_size, seq.prompt_ids
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[-1] if hashes else 0
            end = (i + 1) * bs
            if ids is not None and end <= len(ids):
                hashes.append(hash((parent, ids[i * bs : end].tobytes())))
            else:
                hashes.append(hash((parent, -1 - seq.id)))
        return hashes[index]

    # -- lookups ----------------------------------------------------------------------------

    def longest_hit(self, seq: Sequence) -> int:
        """Blocks of `seq`'s tokens found cached, as `HybridKVCacheCoordinator` finds them."""
        if not self.caching:
            return 0
        cached_global, cached_local = self._cached
        limit = (seq.total - 1) // self.block_size
        hit = 0
        while hit < limit and self.block_hash(seq, hit) in cached_global:
            hit += 1
        if not self.local_weight or not hit:
            return hit
        run = 0
        for i in range(hit - 1, -1, -1):  # right to left, as SlidingWindowManager scans
            if seq.hashes[i] in cached_local:
                run += 1
                if run >= self.local_run:
                    return i + run
            else:
                run = 0
        return run  # the run from block 0 is a hit even if shorter than the window

    def first_needed(self, computed: int) -> int:
        """The first local block the next token's window reaches (earlier ones are skipped)."""
        if not self.window:
            return 0
        return max(0, computed - self.window + 1) // self.block_size

    def admission_cost(self, seq: Sequence, hit: int, end: int) -> int:
        """Units that admitting `seq` with `hit` cached blocks and slots up to `end` takes.

        Touching a free cached block takes it out of the free pool, so such hits cost their
        weight (vLLM's `get_num_blocks_to_allocate` counts them the same way).
        """
        new_blocks = -(-end // self.block_size) - hit
        cost = new_blocks * (self.global_weight + self.local_weight)
        if hit:
            cached_global, cached_local = self._cached
            for i in range(hit):
                if cached_global[seq.hashes[i]].ref == 0:
                    cost += self.global_weight
            if self.local_weight:
                for i in range(self.first_needed(hit * self.block_size), hit):
                    if cached_local[seq.hashes[i]].ref == 0:
                        cost += self.local_weight
        return cost

    # -- what the scheduler does to a sequence ----------------------------------------------

    def admit(self, seq: Sequence, hit: int) -> None:
        """Give a waiting `seq` (holding no blocks) its `hit` cached blocks."""
        cached_global, cached_local = self._cached
        bs = self.block_size
        seq.blocks_global = [self._touch(cached_global[seq.hashes[i]]) for i in range(hit)]
        if self.local_weight:
            first = self.first_needed(hit * bs)
            seq.local_start = first
            seq.blocks_local = [None] * first
            seq.blocks_local.extend(
                self._touch(cached_local[seq.hashes[i]], local=True) for i in range(first, hit)
            )
        seq.registered = hit
        seq.computed = hit * bs

    def allocate(self, seq: Sequence, end: int) -> bool:
        """Slots up to `end` for `seq`, after freeing the local blocks its window has left.

        The skipped blocks are freed even when the allocation then fails, as vLLM's
        `allocate_slots` does. Blocks that the chunk fills are cached at once.
        """
        self.skip(seq, self.first_needed(seq.computed))
        new_blocks = -(-end // self.block_size) - len(seq.blocks_global)
        if new_blocks > 0:
            per_block = self.global_weight + self.local_weight
            if new_blocks * per_block > self.free_units:
                return False
            self._take(new_blocks * per_block)
            seq.blocks_global.extend(Block(self.global_weight) for _ in range(new_blocks))
            if self.local_weight:
                seq.blocks_local.extend(Block(self.local_weight) for _ in range(new_blocks))
        self.register(seq, end // self.block_size)
        return True

    def register(self, seq: Sequence, full: int) -> None:
        """Cache `seq`'s blocks below `full` that are not cached yet."""
        if not self.caching:
            seq.registered = max(seq.registered, full)
            return
        cached_global, cached_local = self._cached
        # Blocks below `known` hold prompt ids, the only content that can be published; 0
        # when events are off, so the loop pays one comparison per block for them.
        ids = seq.prompt_ids
        known = len(ids) // self.block_size if self.events is not None and ids is not None else 0
        run = -1  # the first block of the run of newly cached known blocks, or -1
        for i in range(seq.registered, full):
            key = self.block_hash(seq, i)
            new = self._index(cached_global, seq.blocks_global[i], key, 0)
            if i < known:
                if new and run < 0:
                    run = i
                elif not new and run >= 0:
                    self._stored(seq, run, i)
                    run = -1
            block = seq.blocks_local[i] if self.local_weight else None
            if block is not None:  # sliding-window blocks are never published (kv_events.py)
                self._index(cached_local, block, key, 1)
        if run >= 0:
            self._stored(seq, run, min(full, known))
        seq.registered = max(seq.registered, full)

    def _stored(self, seq: Sequence, first: int, end: int) -> None:
        """Record one `BlockStored` for `seq`'s blocks `first` to `end`, just cached."""
        assert self.events is not None and seq.prompt_ids is not None
        bs, hashes = self.block_size, seq.hashes[first:end]
        self._published.update(hashes)
        parent = seq.hashes[first - 1] if first else None
        ids = seq.prompt_ids[first * bs : end * bs].tolist()
        self.events.append(block_stored(hashes, parent, ids, bs))

    def skip(self, seq: Sequence, first_needed: int) -> None:
        """Free `seq`'s local blocks before `first_needed`, newest first."""
        blocks = seq.blocks_local
        for i in range(min(first_needed, len(blocks)) - 1, seq.local_start - 1, -1):
            block = blocks[i]
            blocks[i] = None
            if block is not None:
                self._release(block, local=True)
        seq.local_start = max(seq.local_start, first_needed)

    def free(self, seq: Sequence) -> None:
        """All of `seq`'s blocks, each kind tail first (`KVCacheManager.free`)."""
        for block in reversed(seq.blocks_global):
            self._release(block)
        for local in reversed(seq.blocks_local):
            if local is not None:
                self._release(local, local=True)
        seq.blocks_global, seq.blocks_local = [], []
        seq.local_start = seq.registered = 0

    # -- the pool ---------------------------------------------------------------------------

    def _take(self, units: int) -> None:
        """Units for fresh blocks: free uncached space first, then the LRU's oldest blocks."""
        while self._plain < units:
            block, _ = self._lru.popitem(last=False)
            self._lru_units -= block.weight
            self._plain += block.weight
            self._forget(block)
        self._plain -= units

    def _touch(self, block: Block, *, local: bool = False) -> Block:
        if block.ref == 0:
            del self._lru[block]
            self._lru_units -= block.weight
        elif block.ref == 1 and local:
            self.shared_local += 1
        block.ref += 1
        return block

    def _release(self, block: Block, *, local: bool = False) -> None:
        block.ref -= 1
        if block.ref:
            if block.ref == 1 and local:
                self.shared_local -= 1
            return
        if block.key is None:
            self._plain += block.weight
        else:
            self._lru[block] = None
            self._lru_units += block.weight

    def _index(self, cached: dict[int, Block], block: Block, key: int, kind: int) -> bool:
        """Cache `block` under `key`; whether the hash is new to the cache."""
        block.key = key
        if key not in cached:
            cached[key] = block
            return True
        # The same content computed twice: vLLM keeps both, the first one is found.
        self._twins.setdefault((kind, key), []).append(block)
        return False

    def _forget(self, block: Block) -> None:
        """Evict a cached block's hash; a twin with the same content takes its place."""
        key, block.key = block.key, None
        for kind, cached in enumerate(self._cached):
            if key is not None and cached.get(key) is block:
                twins = self._twins.get((kind, key))
                if twins:
                    cached[key] = twins.pop(0)
                    if not twins:
                        del self._twins[(kind, key)]
                else:
                    del cached[key]
                    if not kind and key in self._published:
                        self._published.remove(key)
                        assert self.events is not None
                        self.events.append(block_removed(key))
                return
        for kind in (0, 1):
            twins = self._twins.get((kind, key))  # type: ignore[arg-type]
            if twins and block in twins:
                twins.remove(block)
                if not twins:
                    del self._twins[(kind, key)]  # type: ignore[arg-type]
                return
