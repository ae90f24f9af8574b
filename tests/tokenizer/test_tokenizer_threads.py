"""The tokenizer's thread pools keep what their jobs spent: CPU, and the wait for a thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.tokenizer.threads import CountingThreads


async def test_a_job_that_waits_for_the_only_thread_is_counted_with_its_wait() -> None:
    pool = CountingThreads(1, "tokenize-test")
    started, release = threading.Event(), threading.Event()

    def hold() -> bool:
        started.set()
        return release.wait(5.0)

    try:
        first = asyncio.ensure_future(pool.run(hold))
        second = asyncio.ensure_future(pool.run(sum, range(100_000)))
        assert await asyncio.to_thread(started.wait, 5.0)  # its thread may start a moment later
        await asyncio.sleep(0.05)  # the second job is queued behind the first all this time
        release.set()
        assert await first is True
        assert await second == sum(range(100_000))
    finally:
        pool.shutdown()
    assert pool.threads == 1 and pool.jobs == 2
    assert pool.wait_s >= 0.05  # the second job could not start before the first ended
    assert pool.busy_s >= 0.05  # the first job held its thread that long
    assert pool.cpu_s > 0


async def test_a_job_that_fails_still_spent_its_thread() -> None:
    pool = CountingThreads(1, "tokenize-test")
    try:
        with pytest.raises(ZeroDivisionError):
            await pool.run(lambda: 1 / 0)
    finally:
        pool.shutdown()
    assert pool.jobs == 1


async def test_a_job_dropped_before_a_thread_took_it_is_counted_with_its_wait() -> None:
    """Its request was cancelled (the client left) while it queued: the longest waits are the
    ones whose clients give up, so the mean wait must not leave them out."""
    pool = CountingThreads(1, "tokenize-test")
    release = threading.Event()
    try:
        holding = asyncio.ensure_future(pool.run(release.wait, 5.0))
        queued = asyncio.ensure_future(pool.run(sum, range(10)))
        await asyncio.sleep(0.05)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        release.set()
        await holding
    finally:
        pool.shutdown()
    assert pool.jobs == 2
    assert pool.wait_s >= 0.05  # the dropped job's wait, the other's ~0


def test_every_tokenizer_thread_has_encoded_with_each_new_counter_before_traffic(
    tmp_path, tokenizer_dir, monkeypatch
) -> None:
    """A thread's first encode with a tokenizer costs fastokens ~120-140 ms of CPU (Qwen 3,
    Llama 3; 0.1 ms after): compiling the policy, at start or on a reload that builds counters,
    encodes once with each new counter on every thread of both pools, so no request pays it."""
    from gateway.config.load import load_spec
    from gateway.policy.compile import compile_policy, load_policy, reference_problems
    from gateway.tokenizer import backends
    from tests.conftest import basic_policy, write_policy

    encoded: set[tuple[int, str]] = set()  # (encoder, thread)
    for kind in (backends.FastokensEncoder, backends.TokenizersEncoder):
        original = kind.counts

        def counts(self, texts, special, original=original):
            encoded.add((id(self), threading.current_thread().name))
            return original(self, texts, special)

        monkeypatch.setattr(kind, "counts", counts)

    def warmed_threads(policy) -> set[str]:
        encoder = id(policy.models["tiny"].counter.encoder)
        return {t for enc, t in encoded if enc == encoder and t.startswith("tokenize")}

    spec = basic_policy(tokenizer_dir, ["http://127.0.0.1:9"])
    spec["server"] = {"tokenizer_threads": 3}
    policy = load_policy(write_policy(tmp_path, spec))
    every = {f"{prefix}_{i}" for prefix in ("tokenize", "tokenize-large") for i in range(3)}
    try:
        assert warmed_threads(policy) == every
        spec["models"]["tiny"]["max_model_len"] = 4096  # the model's counter is built again
        path = write_policy(tmp_path, spec)
        reloaded = compile_policy(load_spec(path, reference_problems), previous=policy)
        assert reloaded.models["tiny"].counter is not policy.models["tiny"].counter
        assert warmed_threads(reloaded) == every
    finally:
        policy.close()


def test_the_templates_probes_are_answered_as_the_policy_compiles(tmp_path, tokenizer_dir) -> None:
    """What `/v1/messages` asks of a template (does it merge inline system messages, what does
    disabled thinking become) compiles or renders the template, tens of ms: found on the loop of
    a first Messages request by the adversary's profiler run, now answered before traffic."""
    from gateway.policy.compile import load_policy
    from tests.conftest import basic_policy, write_policy

    policy = load_policy(
        write_policy(tmp_path, basic_policy(tokenizer_dir, ["http://127.0.0.1:9"]))
    )
    try:
        answered = vars(policy.models["tiny"].counter.template)
        assert {"merges_inline_system", "disabled_thinking_effort"} <= answered.keys()
    finally:
        policy.close()
