"""Closed-loop users driven straight into the scheduler, in simulated time: no HTTP, no sleeping.

The HTTP sweep (`llm-loadtest sweep` against `llm-loadtest simulate`) is the faithful path: it
measures what a client sees through the same wire format a real replica speaks. It also costs
wall time and CPU, which a CI test cannot spend on four levels of two models. This driver runs
the very same `Scheduler` (vLLM V1's scheduling, KV-cache accounting and roofline step times)
against closed-loop users that resubmit the moment their previous request ends, so a whole
sweep takes seconds of CPU and its result does not depend on the machine's speed.

It also sees what a client cannot: the running batch, the waiting queue and the preemptions at
every step, which is what the fidelity check's KV-cache-wall assertions are about.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from loadtest.sim.engine import DecodeSpan, Scheduler, Step
from loadtest.sim.profiles import Profile
from loadtest.sim.sequence import Sequence, Status

SPAN_CAP_S = 60.0  # simulated seconds a decode span may cover; spans end at a finish anyway


@dataclass(frozen=True, slots=True)
class ClosedLoopLevel:
    """One level's steady state: everything after the warm-up completions, in simulated time."""

    users: int
    completed: int
    duration_s: float
    rps: float
    output_tps: float
    e2e_p95: float
    ttft_p95: float
    tpot_p95: float
    running_mean: float  # time-weighted over the window
    running_max: int
    waiting_mean: float  # time-weighted over the window
    waiting_max: int
    kv_usage_max: float
    preemptions: int  # during the window


def run_closed_loop(
    profile: Profile,
    users: int,
    prompt_tokens: int,
    output_tokens: int,
    *,
    requests: int,
    warmup: int | None = None,
) -> ClosedLoopLevel:
    """`users` closed-loop users with zero think time until `requests` have completed.

    The first `warmup` completions (default: one per user, i.e. the synchronised first wave
    that started together) are left out; the window runs from the last of them to the last
    completion. Outputs are fixed at `output_tokens`, as the load generator's `ignore_eos`.
    """
    warmup = users if warmup is None else warmup
    if requests <= warmup:
        raise ValueError("requests must exceed the warm-up completions")
    scheduler = Scheduler(profile)
    ids = itertools.count()
    clock = 0.0

    def submit() -> Sequence:
        seq = Sequence(next(ids), prompt_tokens, output_tokens, output_tokens)
        seq.arrival = clock
        scheduler.waiting.append(seq)
        return seq

    active = [submit() for _ in range(users)]
    finished: list[Sequence] = []
    window_start: float | None = None
    preempted_before = 0
    running_area = waiting_area = 0.0
    running_max = waiting_max = 0
    kv_max = 0.0
    while len(finished) < requests:
        plan, steps, duration = _next(scheduler, clock)
        if window_start is not None:
            running_area += len(scheduler.running) * duration
            waiting_area += len(scheduler.waiting) * duration
            running_max = max(running_max, len(scheduler.running))
            waiting_max = max(waiting_max, len(scheduler.waiting))
        scheduler.commit(plan, steps, clock)
        clock += duration
        if window_start is not None:
            kv_max = max(kv_max, scheduler.kv_cache_usage)
        still = []
        for seq in active:
            if seq.status is Status.FINISHED:
                finished.append(seq)
                if window_start is None and len(finished) >= warmup:
                    window_start = clock
                    preempted_before = scheduler.stats.preemptions
                still.append(submit())
            else:
                still.append(seq)
        active = still
    assert window_start is not None
    measured = finished[warmup:]
    span = clock - window_start
    e2e = np.array([s.finished_at - s.arrival for s in measured])  # type: ignore[operator]
    ttft = np.array([s.first_token_at - s.arrival for s in measured])  # type: ignore[operator]
    tpot = np.array(
        [
            (s.finished_at - s.first_token_at) / (s.generated - 1)  # type: ignore[operator]
            for s in measured
            if s.generated > 1
        ]
        or [0.0]
    )
    return ClosedLoopLevel(
        users=users,
        completed=len(measured),
        duration_s=span,
        rps=len(measured) / span,
        output_tps=sum(s.generated for s in measured) / span,
        e2e_p95=float(np.percentile(e2e, 95)),
        ttft_p95=float(np.percentile(ttft, 95)),
        tpot_p95=float(np.percentile(tpot, 95)),
        running_mean=running_area / span,
        running_max=running_max,
        waiting_mean=waiting_area / span,
        waiting_max=waiting_max,
        kv_usage_max=kv_max,
        preemptions=scheduler.stats.preemptions - preempted_before,
    )


def _next(scheduler: Scheduler, clock: float) -> tuple[Step | DecodeSpan, int, float]:
    """The scheduler's next step or decode span from `clock`: the plan, its steps, its length."""
    plan = scheduler.plan(clock, SPAN_CAP_S)
    if plan is None:  # cannot happen with users > 0: something always runs or waits
        raise RuntimeError("the scheduler stalled with work queued")
    return plan, plan.steps, plan.end(plan.steps)


@dataclass(frozen=True, slots=True)
class Observed:
    """One request as a gateway in front of the replica saw it (what its latency model reads:
    for TTFT when the request is sent, for TPOT when its first token arrives), and the
    latencies it got, in simulated seconds."""

    users: int
    prompt_tokens: int
    output_tokens: int
    prefill_tokens: int  # when sent: its prompt and those in flight without a first token yet
    decoding: int  # when sent: requests in flight past their first token
    batch: int  # at its first token: requests in flight past theirs, itself included
    context_tokens: int  # at its first token: prompts and outputs of everything in flight
    ttft_s: float
    tpot_s: float | None  # None for a single output token


def observe_closed_loop(
    profile: Profile,
    users: int,
    shapes: Seq[tuple[int, int]],
    *,
    requests: int,
    seed: int = 0,
) -> list[Observed]:
    """`users` closed-loop users, each request's (prompt, output) shape drawn uniformly from
    `shapes`, until `requests` have completed after the first wave (left out, as in
    `run_closed_loop`). The features are what a gateway knows of the replica: the requests it
    sent there, their prompt and output lengths (its reservations), and whether each has
    streamed its first token; read after each step, when a first token can have appeared."""
    if requests < 1:
        raise ValueError("requests must be positive")
    rng = random.Random(f"{seed}:{profile.name}:{users}")
    scheduler = Scheduler(profile)
    ids = itertools.count()
    clock = 0.0
    at_send: dict[int, tuple[int, int]] = {}
    at_first: dict[int, tuple[int, int]] = {}
    active: list[Sequence] = []

    def submit() -> Sequence:
        prompt, output = rng.choice(shapes)
        prefilling = [s for s in active if s.first_token_at is None]
        seq = Sequence(next(ids), prompt, output, output)
        at_send[seq.id] = (
            prompt + sum(s.prompt_tokens for s in prefilling),
            len(active) - len(prefilling),
        )
        seq.arrival = clock
        scheduler.waiting.append(seq)
        active.append(seq)
        return seq

    for _ in range(users):
        submit()
    finished: list[Sequence] = []
    while len(finished) < users + requests:
        plan, steps, duration = _next(scheduler, clock)
        scheduler.commit(plan, steps, clock)
        clock += duration
        decoding = [s for s in active if s.first_token_at is not None]
        context = sum(s.prompt_tokens + s.max_tokens for s in active)
        for s in decoding:
            at_first.setdefault(s.id, (len(decoding), context))
        done = [s for s in active if s.status is Status.FINISHED]
        finished += done
        active[:] = [s for s in active if s.status is not Status.FINISHED]
        for _ in done:
            submit()
    return [_observed(users, s, at_send[s.id], at_first[s.id]) for s in finished[users:]]


def _observed(users: int, s: Sequence, sent: tuple[int, int], first: tuple[int, int]) -> Observed:
    assert s.first_token_at is not None and s.finished_at is not None
    tpot = (s.finished_at - s.first_token_at) / (s.generated - 1) if s.generated > 1 else None
    return Observed(
        users, s.prompt_tokens, s.generated, *sent, *first, s.first_token_at - s.arrival, tpot
    )
