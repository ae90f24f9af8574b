"""The prefix scorer's parts: prompt blocks chained as vLLM chains its token blocks, and the
per-replica index of what was sent where, bounded and closed under prefixes."""

from __future__ import annotations

from gateway.pick.prefix_index import PrefixIndex
from gateway.pick.prompt import chain, prompt_text

RULES = "Rule: no weapons, no drugs, no counterfeits. " * 40  # ~1,800 characters


def chat(*contents: str) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": c} for c in contents]}


def test_prompts_share_exactly_the_blocks_of_their_common_leading_chunks() -> None:
    red = prompt_text(chat(RULES + "Product: a red lamp. " * 9))
    blue = prompt_text(chat(RULES + "Product: a blue chair. " * 9))
    assert isinstance(red, str) and isinstance(blue, str)
    same_chars = next(i for i, (a, b) in enumerate(zip(red, blue, strict=False)) if a != b)
    first, second = chain(None, red, 64, 1024), chain(None, blue, 64, 1024)
    shared = same_chars // 64  # whole chunks before the texts differ
    assert first[:shared] == second[:shared]
    assert first[shared] != second[shared]


def test_a_block_is_chained_from_its_parent_so_equal_chunks_after_different_prefixes_differ() -> (
    None
):
    chunk = "x" * 64
    a = chain(None, "A" * 64 + chunk, 64, 1024)
    b = chain(None, "B" * 64 + chunk, 64, 1024)
    assert a[1] != b[1]


def test_only_full_chunks_are_blocks_and_the_seed_keys_adapters_apart() -> None:
    assert len(chain(None, "y" * 200, 64, 1024)) == 3  # the last 8 characters are no block
    assert chain(None, "y" * 200, 64, 2) == chain(None, "y" * 200, 64, 1024)[:2]
    assert chain(("sql-lora", None), "y" * 64, 64, 9) != chain((None, None), "y" * 64, 64, 9)


def test_token_id_prompts_are_chunked_by_ids() -> None:
    ids = list(range(100))
    assert prompt_text({"prompt": ids}) == ids
    assert len(chain(None, ids, 64, 1024)) == 100 // 16


def test_the_index_finds_the_longest_prefix_each_replica_was_sent() -> None:
    index = PrefixIndex(capacity_blocks=100)
    index.record("http://a", [1, 2, 3, 4])
    index.record("http://b", [1, 2])
    assert index.matched("http://a", [1, 2, 3, 9]) == 3
    assert index.matched("http://b", [1, 2, 3, 9]) == 2
    assert index.matched("http://c", [1, 2, 3, 9]) == 0
    assert index.matched("http://a", [7, 2, 3]) == 0


def test_the_index_is_bounded_per_replica_and_evicts_leaf_blocks_first() -> None:
    index = PrefixIndex(capacity_blocks=6)
    index.record("http://a", [1, 2, 3, 4])  # a shared rule set, then one product
    index.record("http://a", [1, 2, 5, 6])
    index.record("http://a", [1, 2, 7, 8])
    assert index.size("http://a") == 6
    # The oldest leaves went first; the shared prefix, refreshed by every request, stayed.
    assert index.matched("http://a", [1, 2, 3, 4]) == 2
    assert index.matched("http://a", [1, 2, 7, 8]) == 4
    index.record("http://b", list(range(100, 200)))
    assert index.size("http://b") == 6
    assert index.matched("http://b", list(range(100, 200))) == 6  # the first six, a prefix


def test_a_replica_that_leaves_or_restarts_is_forgotten() -> None:
    index = PrefixIndex(capacity_blocks=10)
    index.record("http://a", [1, 2])
    index.forget("http://a")
    assert index.matched("http://a", [1, 2]) == 0
    assert index.size("http://a") == 0


def test_a_huge_prompt_hashes_only_its_first_max_blocks() -> None:
    assert len(chain(None, "z" * 1_000_000, 256, 1024)) == 1024  # bounded work and memory
