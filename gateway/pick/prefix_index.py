"""Which prompt blocks this gateway sent to which replica: the prefix scorer's estimate of what
each replica's prefix cache holds (the EPP's "estimation mode"), bounded per replica.

Each replica has an LRU of block hashes. A request's blocks are recorded from its last to its
first, so a block's parent is always more recent than the block itself and is evicted after
it: what the index holds for a replica is closed under prefixes, and the longest prefix a
replica holds is found by binary search over the request's blocks. A replica that leaves the
pool, restarts or is ejected is forgotten: its cache is gone, or will be.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence


def longest_prefix(blocks: Sequence[int], held: Container[int]) -> int:
    """The largest k with `blocks[:k]` all in `held`, by binary search: `held` must be closed
    under prefixes (a block held only if its parent is)."""
    if not blocks or blocks[0] not in held:
        return 0
    low, high = 1, len(blocks)  # blocks[:low] held; find the largest such low
    while low < high:
        mid = (low + high + 1) // 2
        if blocks[mid - 1] in held:
            low = mid
        else:
            high = mid - 1
    return low


class PrefixIndex:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._held: dict[str, OrderedDict[int, None]] = {}

    def matched(self, url: str, blocks: Sequence[int]) -> int:
        """How many of `blocks`, from the first, the replica was last sent (and still holds)."""
        held = self._held.get(url)
        return longest_prefix(blocks, held) if held else 0

    def record(self, url: str, blocks: Sequence[int]) -> None:
        held = self._held.get(url)
        if held is None:
            held = self._held[url] = OrderedDict()
        for block in reversed(blocks):
            if block in held:
                held.move_to_end(block)
            else:
                held[block] = None
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, url: str) -> None:
        self._held.pop(url, None)

    def size(self, url: str) -> int:
        held = self._held.get(url)
        return len(held) if held else 0
