"""The generative adversary's short profile: issue 35's promises Q, C, L and S (and no redirect
followed) after a seeded run of random requests on every endpoint against the real gateway as a
process, behind a replica that lies on cue; one gateway, two sharing a real `redis-server` that
is stopped and restarted mid-run, and one pod of two workers (`serve --workers 2`, as the chart
runs it) sharing one likewise. Three fixed seeds, and one fresh seed each session, printed in
the failure with the command that replays it. The long profile is `make fuzz`."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from gateway.state.failover import RETRY_S
from loadtest.adversary.checks import check, check_quota, check_refusals, check_slo
from loadtest.adversary.count import Counter, messages_chat
from loadtest.adversary.endpoints import DRAWN, NOT_DRAWN, unaccounted
from loadtest.adversary.generator import Generator, Planned, fresh_seed
from loadtest.adversary.harness import (
    OUTPUT_CAPS,
    REDIS_TIMEOUT_S,
    SLO,
    TENANTS,
    Outcome,
    Run,
    execute,
)
from loadtest.adversary.replica import Arrival, Script
from loadtest.adversary.slow_link import SlowLink
from loadtest.real_tokenizers import directory

SECONDS = 10.0  # of attack; the gateways' start (three real tokenizers) takes longer than that

FRESH = fresh_seed()
# Seed 36's two gateways draw quota slices of 0.2, spare slot leases of 0.5 s, and 4 slots of
# each replica reserved for `tight`: a spare of one class held when the other's request comes.


@pytest.mark.parametrize(
    ("seed", "gateways", "workers"),
    [(35, 1, 1), (36, 2, 1), (37, 1, 2), (FRESH, 1, 1)],
    ids=["fixed-one", "fixed-two", "fixed-pod", "fresh"],
)
async def test_promises_hold_against_the_adversary(
    tmp_path: Path, seed: int, gateways: int, workers: int
):
    run = await execute(seed, SECONDS, gateways, tmp_path, backend="tokenizers", workers=workers)
    assert run.outcomes, "the adversary sent nothing"
    broken = check(run)
    replay = (
        f"replay: python -m loadtest.adversary --seed {seed} --seconds {SECONDS:g}"
        f" --gateways {gateways} --workers {workers} --backend tokenizers"
    )
    assert not broken, "\n".join([*(b.line(seed) for b in broken), replay])


def test_every_registered_endpoint_is_drawn_or_said_why_not() -> None:
    """The adversary's endpoints come from the gateway's registry: one registered and neither
    drawn (a body to draw, a replica's answer, a count) nor listed in `NOT_DRAWN` with its
    reason fails here, before any run."""
    assert not unaccounted(), (
        f"registered endpoints the adversary neither draws nor names in NOT_DRAWN: {unaccounted()}"
        " (loadtest/adversary/endpoints.py)"
    )
    assert not set(DRAWN) & set(NOT_DRAWN)
    assert all(hasattr(Generator, f"_{name}_body") for name in DRAWN)


def test_the_independent_count_converts_messages_as_vllm_does() -> None:
    """vLLM's Anthropic server drops empty text blocks, makes one text block a string and drops
    a user message left with none (`_convert_message_content`): found by the long profile, where
    the count had kept an empty block as a trailing line."""
    body = {
        "system": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": ""}],
            },
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": ""}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
    }
    assert messages_chat(body) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]


def _after_a_restart(first_sent_s: float, **redis: tuple[float, ...]) -> Run:
    """A run whose Redis was away from +3.5 s to +5.6 s (or as `redis` says), and a tenant
    that got 0.6 of its TPM in 6 requests sent from `first_sent_s` on, then, from a second
    later, its whole TPM in 20."""
    tpm = TENANTS["beta"][0]
    run = Run(seed=36, gateways=2, seconds=10.0, started=1000.0, redis_down=(1003.5, 1005.6))
    for name, value in redis.items():
        setattr(run, name, value)
    sends = [(first_sent_s + i / 10, tpm // 10) for i in range(6)]
    sends += [(first_sent_s + 1 + i / 10, tpm // 20) for i in range(20)]
    for i, (at, tokens) in enumerate(sends):
        nonce, sent = f"adv-{i:012x}", run.started + at
        planned = Planned(nonce, "beta", i % 2, "chat", "m", {}, Script())
        run.outcomes.append(Outcome(planned, sent, status=200))
        got = Arrival("chat", "m", nonce, sent, prompt_tokens=tokens, finished=True)
        run.ledger.arrivals[nonce] = [got]
    return run


def test_a_window_from_redis_return_allows_the_gateways_retry_only():
    """Two gateways count locally until each tries Redis again, a second after its last failure
    (whose call may have taken its whole time-out): a window that starts within that of Redis'
    return may hold what they counted locally and a TPM in the emptied Redis. Seed 36 with two
    gateways failed Q once in two runs on a window starting 6 ms after Redis was back. A window
    starting once every gateway has tried Redis again is held to its TPM."""
    retried = 5.6 + REDIS_TIMEOUT_S + RETRY_S
    assert not check_quota(_after_a_restart(5.6 + 0.05))
    assert check_quota(_after_a_restart(retried + 0.05))


def test_redis_late_allows_one_more_tpm_however_late():
    """Replies held send the gateways to their local shares while Redis keeps what it did: a
    window that sees it may hold one more TPM (this tenant's 1.6). Held 0.05 s, under the 0.2 s
    time-out, they still do: a pod of two workers fell back to its local shares within seconds
    of such a spell (its calls timed out), and seed 125071480 broke Q there while the check
    allowed nothing. Without a spell, the window is held to its TPM."""
    spell = (1001.0, 1002.5)
    for held_s in (0.5, 0.05):
        assert not check_quota(_after_a_restart(1.2, redis_down=None, redis_slow=(*spell, held_s)))
    assert check_quota(_after_a_restart(1.2, redis_down=None))


async def test_the_slow_link_holds_redis_replies_and_closes_with_redis(fresh_redis) -> None:
    link = SlowLink(fresh_redis.port)
    async with link.serving() as url:
        client = aioredis.Redis.from_url(url, socket_timeout=0.2)
        try:
            assert await client.ping()
            link.delay_s = 0.5
            with pytest.raises(redis_errors.TimeoutError):
                await client.ping()
            link.delay_s = 0.0
            assert await client.ping()
            fresh_redis.stop()
            with pytest.raises(redis_errors.ConnectionError):
                await client.ping()
        finally:
            await client.aclose()


def test_the_independent_count_drops_empty_text_parts_as_vllm_does() -> None:
    """For a template that reads a string, vLLM joins a message's text parts with newlines and
    keeps only parts whose parse is truthy: an empty text is no line of its own. Found by the
    long profile with two gateways (gateway 241, harness 242 on Qwen 3)."""
    counter = Counter({"qwen3": directory("qwen3")})
    parts = [{"type": "text", "text": "stone thunder"}, {"type": "text", "text": ""}]
    with_empty = counter.chat("qwen3", [{"role": "user", "content": parts}])
    assert with_empty == counter.chat("qwen3", [{"role": "user", "content": "stone thunder"}])


def test_r_expects_the_refusal_of_a_bound_over_its_pools_and_no_other() -> None:
    """A chat asking its pool's `max_output_tokens` plus one (`n` 1) must be refused (400, or a
    429 from the tenant's windows first) and reach no replica; one within it must not be."""
    model, cap = next(iter(OUTPUT_CAPS.items()))
    run = Run(seed=0, gateways=1, seconds=1.0)
    for i, (bound, status) in enumerate(((cap + 1, 200), (cap + 1, 400), (cap, 200))):
        body = {"model": model, "messages": [], "max_tokens": bound}
        run.outcomes.append(
            Outcome(
                Planned(f"adv-{i:012x}", "alpha", 0, "chat", model, body, Script()), 0.0, status
            )
        )
    [broken] = check_refusals(run)
    assert broken.promise == "R" and broken.nonces == ["adv-000000000000"]


def _slo_run(*rows: tuple[list[tuple[str, str]], int, dict[str, object]]) -> Run:
    """A run of chats on the pool with `slo` that reads headers, each (headers, status, its
    access-log line's fields), none reaching a replica."""
    model = next(m for m, slo in SLO.items() if slo.get("headers") is not False)
    run = Run(seed=0, gateways=1, seconds=1.0)
    for i, (headers, status, line) in enumerate(rows):
        nonce = f"adv-{i:012x}"
        planned = Planned(nonce, "alpha", 0, "chat", model, {}, Script(), headers=headers)
        run.ledger.scripts[nonce] = planned.script
        run.outcomes.append(Outcome(planned, 0.0, status, retry_after="2", refusal=b""))
        run.access.append({"request_id": nonce, "gateway": 0, "pool": model, **line})
    return run


def test_the_slo_checks_see_what_they_promise() -> None:
    """Each of check_slo's promises fails on a run that breaks it, and holds on its mirror:
    a hostile header served, a valid one refused as invalid, `slo_unreachable` to a standard
    request or without its code, a client-only header upstream, an objective counted twice."""
    hostile, valid = [("x-slo-ttft-ms", "nan")], [("x-llm-d-slo-ttft-ms", "1e-320")]
    shed = [("x-priority", "sheddable"), *valid]
    unreachable = {"reason": "slo_unreachable", "status": 429}
    assert not check_slo(_slo_run((hostile, 400, {"reason": "invalid_slo"}), (valid, 200, {})))
    [served] = check_slo(_slo_run((hostile, 200, {})))
    [refused] = check_slo(_slo_run((valid, 400, {"reason": "invalid_slo"})))
    both = [("x-slo-ttft-ms", "900"), ("x-llm-d-slo-ttft-ms", "nan"), ("x-slo-ttft-ms", "nan")]
    assert not check_slo(_slo_run((both, 200, {})))  # ours first, its first value
    run = _slo_run((shed, 429, unreachable))
    run.outcomes[0].refusal = b'{"error": {"code": "slo_unreachable"}}'
    assert not check_slo(run)
    # A replica that reset it before its head sent it back to the queue, where its retry found
    # the objective unreachable: still a refusal before any replica answered.
    nonce = run.outcomes[0].planned.nonce
    run.ledger.arrivals[nonce] = [Arrival("chat", "gemma3", "", 0.0)]
    run.outcomes[0].planned.script.transport = "reset_head"
    assert not check_slo(run)
    run.outcomes[0].planned.script.transport = "ok"
    [answered] = check_slo(run)
    del run.ledger.arrivals[nonce]
    [standard] = check_slo(_slo_run((valid, 429, unreachable)))
    assert {b.promise for b in (served, refused, answered, standard)} == {"R"}
    run.access[0]["slo_ttft_s"] = 0.0
    run.metrics = [
        "# TYPE llm_slo_requests_total counter\n"
        'llm_slo_requests_total{pool="gemma3",tier="sheddable",objective="ttft",'
        'outcome="refused"} 2.0\n'
    ]
    run.ledger.arrivals[run.outcomes[0].planned.nonce] = [
        Arrival("chat", "gemma3", "", 0.0, leaked_headers=("X-Slo-Ttft-Ms",))
    ]
    assert sorted(b.promise for b in check_slo(run)) == ["R", "S", "X"]
