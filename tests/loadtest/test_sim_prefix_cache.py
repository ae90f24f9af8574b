"""The simulator's prefix cache, as vLLM V1's: full blocks hashed in a chain from the first, hits
looked up at admission, only the uncached tokens prefilled, freed blocks kept until the
allocator needs them, and vLLM's own counters for it."""

from __future__ import annotations

from array import array
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.sim.engine import Scheduler
from loadtest.sim.profiles import Profile
from loadtest.sim.sequence import Sequence
from loadtest.sim.server import ReplicaOptions, start_replica
from tests.loadtest.test_simulator import write_profile

BLOCK = 16  # the tiny profile's block size; its sliding window is 64 tokens


@pytest.fixture
def tiny(tmp_path: Path) -> Profile:
    return write_profile(tmp_path, serving={"block_size": BLOCK})


def ids(*runs: range) -> array:
    out = array("q")
    for run in runs:
        out.extend(run)
    return out


def run(scheduler: Scheduler, *seqs: Sequence) -> None:
    """Admit `seqs` together and step the engine until all finish."""
    scheduler.waiting.extend(seqs)
    clock = 0.0
    for _ in range(100_000):
        if not scheduler.has_work():
            return
        plan = scheduler.plan(clock, 1e9)
        assert plan is not None
        scheduler.commit(plan, plan.steps, clock)
        clock += plan.end(plan.steps)
    raise AssertionError("the engine did not finish")


def request(seq_id: int, prompt: array, out: int = 4) -> Sequence:
    return Sequence(seq_id, len(prompt), out, out, prompt)


def test_a_repeated_prompt_hits_every_full_block_but_recomputes_its_last_token(
    tiny: Profile,
) -> None:
    scheduler = Scheduler(tiny)
    prompt = ids(range(100))
    first, second = request(0, prompt), request(1, prompt)
    run(scheduler, first)
    run(scheduler, second)
    # 100 tokens: 6 full blocks; at most 99 tokens can hit, so the hit is 96 (vLLM's rule).
    assert (first.cached_tokens, second.cached_tokens) == (0, 96)
    stats = scheduler.stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (200, 96)
    assert stats.prefill_tokens_computed == 100 + 4
    assert scheduler.free_units == scheduler.geometry.capacity_units  # cached blocks are free


def test_a_partial_last_block_is_never_cached(tiny: Profile) -> None:
    scheduler = Scheduler(tiny)
    run(scheduler, request(0, ids(range(40))))
    again = request(1, ids(range(40)))
    run(scheduler, again)
    assert again.cached_tokens == 2 * BLOCK  # blocks 0-1; tokens 32-39 were no block


def test_blocks_are_chained_so_equal_content_after_another_prefix_misses(tiny: Profile) -> None:
    scheduler = Scheduler(tiny)
    run(scheduler, request(0, ids(range(0, 16), range(100, 164))))
    other_start = request(1, ids(range(500, 516), range(100, 164)))  # same blocks 1-4, new 0
    run(scheduler, other_start)
    assert other_start.cached_tokens == 0
    shared_start = request(2, ids(range(0, 16), range(100, 132), range(900, 932)))
    run(scheduler, shared_start)
    assert shared_start.cached_tokens == 3 * BLOCK


def test_prompts_sharing_a_prefix_prefill_only_what_differs_and_answer_sooner(
    tiny: Profile,
) -> None:
    scheduler = Scheduler(tiny)
    rules = range(10_000, 10_192)  # 12 blocks shared by every request
    first = request(0, ids(rules, range(0, 40)))
    run(scheduler, first)
    later = request(1, ids(rules, range(40, 80)))
    run(scheduler, later)
    assert later.cached_tokens == 192
    assert scheduler.stats.prefill_tokens_computed == 232 + 40
    assert (later.first_token_at - later.arrival) < (first.first_token_at - first.arrival)


@pytest.mark.parametrize(
    ("pressure", "old_left", "new_left"), [(800, 3, 3), (950, 2, 3), (1000, 0, 3)]
)
def test_cached_blocks_are_evicted_only_under_pressure_oldest_first_tail_first(
    tiny: Profile, pressure: int, old_left: int, new_left: int
) -> None:
    """Two finished 64-token prompts stay cached (3 hittable blocks each) until a request needs
    their space: then the older one goes first, its tail block before its head."""
    scheduler = Scheduler(tiny)
    old, new = ids(range(0, 64)), ids(range(1000, 1064))
    run(scheduler, request(0, old))
    run(scheduler, request(1, new))
    run(scheduler, request(2, ids(range(20_000, 20_000 + pressure))))
    hits = [scheduler.kv.longest_hit(request(n, p)) for n, p in ((3, old), (4, new))]
    assert hits == [old_left, new_left]


def test_with_prefix_caching_off_every_token_is_computed(tiny: Profile) -> None:
    scheduler = Scheduler(tiny, enable_prefix_caching=False)
    prompt = ids(range(100))
    second = request(1, prompt)
    run(scheduler, request(0, prompt))
    run(scheduler, second)
    assert second.cached_tokens == 0
    assert (scheduler.stats.prefix_cache_queries, scheduler.stats.prefix_cache_hits) == (0, 0)
    assert scheduler.stats.prefill_tokens_computed == 200


async def test_a_replica_exports_vllms_prefix_cache_counters(tmp_path: Path) -> None:
    profile = write_profile(tmp_path, serving={"block_size": BLOCK})
    replica = await start_replica(profile, ReplicaOptions(time_scale=1000))
    body = {"model": "tiny", "max_tokens": 2, "ignore_eos": True,
            "messages": [{"role": "user", "content": "rules " * 100}]}  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(2):
                async with http.post(f"{replica.url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
            async with http.get(f"{replica.url}/metrics") as resp:
                text = await resp.text()
    finally:
        await replica.close()
    found = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith(("vllm:prefix_cache", "vllm:prompt_tokens"))
    }
    prompt = found["vllm:prompt_tokens_total"] / 2  # 600 characters, 4 a token, + 4 markers
    assert found["vllm:prefix_cache_queries_total"] == 2 * prompt
    hit = found["vllm:prefix_cache_hits_total"]
    assert hit == (prompt - 1) // BLOCK * BLOCK  # the second request's full blocks
    assert found["vllm:prompt_tokens_cached_total"] == hit


async def test_without_a_tokenizer_texts_that_differ_anywhere_get_different_ids() -> None:
    """Pseudo-tokens are four characters each, every character counted: two product tags that
    differ in one digit never share a block (a lossy id once made them hit each other)."""
    from loadtest.sim.tokens import prompt_encoder

    encoder = prompt_encoder(None)
    texts = ["Product 12: lamp", "Product 13: lamp", "Product 1😀: lamp", "x"]
    ids = [await encoder.encode_completion({"prompt": t}) for t in texts]
    assert [len(i) for i in ids] == [4, 4, 4, 1]  # 4 characters a token, the last may be short
    assert len({i.tobytes() for i in ids}) == 4
