"""The simulated engine: vLLM V1's continuous-batching scheduler, timed by a roofline.

`Scheduler` is synchronous and knows nothing of wall time. Each step it does what vLLM V1's
`Scheduler.schedule()` does, in the same order:

1. running sequences, oldest first, each take the tokens they still need (one for a decode,
   a chunk for an unfinished prefill or a recompute) out of a `max_num_batched_tokens` budget;
   each allocation of KV blocks that does not fit preempts the newest running sequence (its
   blocks freed, itself put back at the head of the waiting queue, its tokens recomputed
   later), until it fits or the sequence preempted itself;
2. only if nothing was preempted, waiting sequences are admitted in order while the budget,
   `max_num_seqs` and the free blocks allow, each with a (chunked) prefill of the tokens its
   prefix-cache hit (looked up at each admission, a re-admission after preemption included)
   does not cover; the KV cache and its prefix cache are `kv_cache.KVCache`, a request is a
   `sequence.Sequence`.

The step's duration comes from `Roofline`. When every running sequence is decoding and no
waiting one could be admitted, steps are all alike; the scheduler then computes many of them
at once (a decode span) with per-step work independent of the batch size, which is what lets
one Python process simulate 128 streams at a high time scale. A span stops at the first
finish, at a step needing a preemption, at a step after which a waiting sequence fits, and
after `span_cap_s`; the engine also cuts it short when a request arrives or is aborted, so an
arrival joins at the next step boundary exactly as in the step-by-step loop.

`Engine` runs the scheduler against the wall clock: simulated time advances `time_scale`
times faster than wall time, and the engine sleeps until each step's (or span's) end. If the
process cannot keep up, the simulated clock slips (counted in `slip_s`) rather than reporting
steps faster than they could have been served. With a `KVEventPublisher`, the KV-cache events
of each committed step (or span: one batch for all its steps) are published after it, as vLLM
publishes a step's after its model output.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass

from loadtest.sim.kv_cache import KVCache
from loadtest.sim.kv_events import KVEventPublisher
from loadtest.sim.metrics import EngineStats
from loadtest.sim.profiles import CacheGeometry, OutputLengths, Profile, cache_geometry
from loadtest.sim.roofline import BatchShape, Roofline
from loadtest.sim.sequence import Sequence, Status, _resolve
from loadtest.sim.tokens import PromptIds

log = logging.getLogger("loadtest.sim")

MAX_SPAN_STEPS = 4096  # bounds a span's step list whatever the cap and batch
MIN_SLEEP_S = 0.0005  # below this the loop yields instead of arming a timer (uvloop has ms timers)
SLIP_TOLERANCE_S = 0.05  # wall seconds the engine may lag before its clock slips


@dataclass(slots=True)
class Step:
    """One step as vLLM V1 schedules it."""

    scheduled: list[tuple[Sequence, int]]
    preempted: int
    duration: float

    @property
    def steps(self) -> int:
        return 1

    def end(self, k: int) -> float:
        return self.duration

    def steps_through(self, offset: float) -> int:
        return 1


@dataclass(slots=True)
class DecodeSpan:
    """Consecutive pure-decode steps of the same sequences; `ends` are cumulative offsets."""

    seqs: list[Sequence]
    ends: list[float]

    @property
    def steps(self) -> int:
        return len(self.ends)

    def end(self, k: int) -> float:
        return self.ends[k - 1]

    def steps_through(self, offset: float) -> int:
        """Steps that must complete for something arriving `offset` into the span: the ones
        already over, and the one in flight (a step is never interrupted)."""
        return min(bisect_right(self.ends, offset) + 1, len(self.ends))


class Scheduler:
    """vLLM V1's scheduling and KV-cache accounting over simulated time (see module doc)."""

    def __init__(
        self, profile: Profile, *, fast_forward: bool = True, enable_prefix_caching: bool = True
    ) -> None:
        self.geometry: CacheGeometry = cache_geometry(profile)
        self.kv = KVCache(self.geometry, enable_prefix_caching=enable_prefix_caching)
        self.roofline = Roofline(profile)
        self.max_batched = profile.serving.max_num_batched_tokens
        self.max_seqs = profile.serving.max_num_seqs
        self.window = self.geometry.window if self.geometry.local_layers else 0
        self.fast_forward = fast_forward
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.stats = EngineStats()

    @property
    def free_units(self) -> int:
        """Free layer-blocks, cached ones included (they are reused on demand)."""
        return self.kv.free_units

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.kv.free_units / self.geometry.capacity_units

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def plan(self, start: float, span_cap_s: float) -> Step | DecodeSpan | None:
        """The next step (or span) beginning at `start`; None if nothing can run."""
        if self.fast_forward and span_cap_s > 0:
            span = self._plan_decode_span(span_cap_s)
            if span is not None:
                return span
        return self._plan_step(start)

    def commit(self, span: Step | DecodeSpan, steps: int, start: float) -> None:
        """Apply the first `steps` steps of a plan that began at `start`."""
        if isinstance(span, Step):
            self._commit_step(span, start + span.duration)
        else:
            self._commit_decode(span, steps, start)

    def abort(self, seq: Sequence) -> None:
        """A client left: free its blocks like vLLM's abort_request. Idempotent."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._free(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        else:
            return
        seq.status = Status.ABORTED
        seq.notify(True)

    # -- one step, as V1 does it ------------------------------------------------------------

    def _allocate(self, seq: Sequence, new: int) -> bool:
        return self.kv.allocate(seq, seq.computed + new)

    def _free(self, seq: Sequence) -> None:
        self.kv.free(seq)

    def _hit(self, seq: Sequence, budget: int) -> tuple[int, int, int]:
        """A waiting sequence's prefix-cache hit (blocks), chunk and the units admitting it takes."""
        hit = self.kv.longest_hit(seq)
        start = hit * self.geometry.block_size
        new = min(seq.total - start, budget)
        return hit, new, self.kv.admission_cost(seq, hit, start + new)

    def _admit(self, seq: Sequence, hit: int, new: int) -> None:
        """Take `hit` cached blocks and slots for `new` tokens; counted as vLLM counts them."""
        kv, stats = self.kv, self.stats
        kv.admit(seq, hit)
        allocated = kv.allocate(seq, seq.computed + new)
        assert allocated, "admission_cost said it fits"
        if not seq.preemptions:  # PrefixCacheStats.record keeps preempted requests apart
            seq.cached_tokens = seq.computed
            if kv.caching:
                stats.prefix_cache_queries += seq.total
                stats.prefix_cache_hits += seq.computed

    def _allocate_or_preempt(self, seq: Sequence, new: int) -> tuple[bool, int]:
        """While `seq`'s blocks do not fit, preempt the newest running sequence.

        Returns (scheduled, preemptions); not scheduled when `seq` was itself the newest.
        """
        preempted = 0
        while not self._allocate(seq, new):
            victim = self.running.pop()
            self._free(victim)
            victim.computed = 0
            victim.status = Status.WAITING
            victim.preemptions += 1
            self.waiting.appendleft(victim)
            preempted += 1
            if victim is seq:
                return False, preempted
        return True, preempted

    def _plan_step(self, start: float) -> Step | None:
        budget = self.max_batched
        shape = BatchShape()
        scheduled: list[tuple[Sequence, int]] = []
        preempted = 0
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            new = min(seq.total - seq.computed, budget)
            ok, n = self._allocate_or_preempt(seq, new)
            preempted += n
            if not ok:
                break
            shape.add(seq.computed, new, seq.computed + new == seq.total, self.window)
            scheduled.append((seq, new))
            budget -= new
            index += 1
        # V1 admits nobody in a step that had to preempt: the cache is already over-committed.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            hit, new, cost = self._hit(seq, budget)
            if cost > self.kv.free_units:
                break
            self._admit(seq, hit, new)
            self.waiting.popleft()
            self.running.append(seq)
            seq.status = Status.RUNNING
            if seq.scheduled_at is None:
                seq.scheduled_at = start
            shape.add(seq.computed, new, seq.computed + new == seq.total, self.window)
            scheduled.append((seq, new))
            budget -= new
        if not scheduled and not preempted:
            return None
        return Step(scheduled, preempted, self.roofline.step_time(shape))

    def _commit_step(self, step: Step, end: float) -> None:
        self.stats.steps += 1
        self.stats.preemptions += step.preempted
        for seq, new in step.scheduled:
            if seq.first_token_at is None or seq.total - seq.computed > 1:
                self.stats.prefill_tokens_computed += new  # a prefill or recompute chunk
            seq.computed += new
            if seq.computed == seq.total:  # the chunk reached the end: a token is sampled
                self._emit(seq, end)

    def _emit(self, seq: Sequence, at: float) -> None:
        stats = self.stats
        seq.generated += 1
        stats.generation_tokens += 1
        if seq.first_token_at is None:
            seq.first_token_at = at
            stats.ttft.observe(at - seq.arrival)
            stats.prompt_tokens += seq.prompt_tokens  # once, however often it is recomputed
            stats.prompt_tokens_cached += seq.cached_tokens
        else:
            stats.itl.observe(at - seq.last_token_at)
        seq.last_token_at = at
        if seq.generated >= seq.target:
            self._finish(seq, at)
        else:
            seq.notify(False)

    def _finish(self, seq: Sequence, at: float) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.status = Status.FINISHED
        seq.finished_at = at
        seq.finish_reason = "length" if seq.generated >= seq.max_tokens else "stop"
        stats = self.stats
        stats.success[seq.finish_reason] += 1
        stats.e2e.observe(at - seq.arrival)
        scheduled = at if seq.scheduled_at is None else seq.scheduled_at
        stats.queue.observe(scheduled - seq.arrival)
        seq.notify(True)

    # -- many identical decode steps at once ------------------------------------------------

    def _admission_need(self, batch: int) -> int | None:
        """Units the waiting head needs to be admitted beside `batch` decodes; None: it can't.

        During a span the head's need can only grow (running sequences may evict blocks it
        would hit), so a span that stops where this need fits stops early, never late.
        """
        room = self.max_batched - batch
        if not self.waiting or batch >= self.max_seqs or room <= 0:
            return None
        return self._hit(self.waiting[0], room)[2]

    def _shared_local_frees(self, running: list[Sequence]) -> dict[int, int]:
        """Per span step, the units of freed local blocks another holder still references.

        The residue counts below return a block to the pool for each holder that frees it;
        a block that several sequences share returns only with its last holder.
        """
        kv = self.kv
        bs, window = kv.block_size, kv.window
        frees: dict[int, list[int]] = {}
        for seq in running:
            c, blocks = seq.computed, seq.blocks_local
            for j in range(seq.local_start, len(blocks)):
                block = blocks[j]
                if block is not None and block.ref > 1:
                    frees.setdefault(id(block), []).append(max(1, (j + 1) * bs + window - c))
        kept: dict[int, int] = {}
        for steps in frees.values():
            steps.sort()
            for k in steps[:-1]:
                kept[k] = kept.get(k, 0) + kv.local_weight
        return kept

    def _plan_decode_span(self, cap_s: float) -> DecodeSpan | None:
        """Steps in which every running sequence decodes one token and nothing else changes.

        Step 1's block delta is exact per sequence: one fresh from prefill may still hold local
        blocks its window has left, and frees them now. From step 2 on, a sequence gains a
        block when the token it writes starts one and frees a local block when its window
        leaves one, both at fixed residues of its position modulo the block size, so counts by
        residue give each step's delta, and running sums its attention context, without
        visiting the sequences again.
        """
        running = self.running
        batch = len(running)
        if not batch or batch > self.max_batched:
            return None
        if self.waiting and self.kv.longest_hit(self.waiting[0]):
            # The head's need depends on which of its cached blocks the span's growth evicts,
            # block by block: only the step loop gets that exactly (a preempted sequence
            # re-hitting its own blocks is the common case). Steps one by one until it is in.
            return None
        geo, kv = self.geometry, self.kv
        bs = geo.block_size
        per_new_block = geo.global_layers + geo.local_layers
        by_residue = [0] * bs
        delta = grow = context = 0
        remaining = math.inf
        for seq in running:
            c = seq.computed
            if seq.total - c != 1 or not seq.generated:
                return None
            new_blocks = c // bs + 1 - len(seq.blocks_global)
            if new_blocks > 0:
                grow += per_new_block * new_blocks
            skipped = kv.first_needed(c) - seq.local_start
            delta -= geo.local_layers * max(0, skipped)
            left = seq.target - seq.generated
            if left < remaining:
                remaining = left
            context += c
            by_residue[c % bs] += 1
        delta += grow
        need = self._admission_need(batch)
        window = self.window
        kept = self._shared_local_frees(running) if kv.shared_local else {}
        # Longest contexts first: they reach the window (and start freeing blocks) first.
        order = sorted((seq.computed for seq in running), reverse=True)
        capped = capped_ptr = freeing_ptr = 0
        uncapped_context = context
        freeing_by_residue = [0] * bs
        free = self.free_units
        ends: list[float] = []
        total = 0.0
        decode_time = self.roofline.decode_time
        for k in range(1, MAX_SPAN_STEPS + 1):
            if k > 1:
                grow = delta = per_new_block * by_residue[(1 - k) % bs]
                if window:
                    while freeing_ptr < batch and order[freeing_ptr] + k - 1 >= window + bs - 1:
                        freeing_by_residue[order[freeing_ptr] % bs] += 1
                        freeing_ptr += 1
                    delta -= geo.local_layers * freeing_by_residue[(window - k) % bs]
            if kept:
                delta += kept.get(k, 0)
            # vLLM allocates sequence by sequence: a later one's freed blocks cannot save an
            # earlier one, so only a step whose growth alone fits is sure to need no preemption.
            if grow > free or (need is not None and free - delta >= need):
                break
            free -= delta
            local = 0
            if window:
                while capped_ptr < batch and order[capped_ptr] + k >= window:
                    uncapped_context -= order[capped_ptr]
                    capped += 1
                    capped_ptr += 1
                local = window * capped + uncapped_context + k * (batch - capped)
            total += decode_time(batch, context + k * batch, local)
            ends.append(total)
            if k >= remaining or total >= cap_s:
                break
        return DecodeSpan(list(running), ends) if ends else None

    def _span_blocks(self, seqs: list[Sequence], steps: int) -> None:
        """The block changes of `steps` decode steps, in the order step-by-step makes them.

        Only the steps at which a sequence starts a block or its window leaves one change
        anything, so the work is O(blocks changed); the order (step, then sequence) is the
        step loop's, so the same cached blocks are evicted and freed as there.
        """
        kv = self.kv
        bs, window = kv.block_size, kv.window
        events: list[tuple[int, int]] = []
        for index, seq in enumerate(seqs):
            c = seq.computed
            at = {b * bs - c + 1 for b in range(len(seq.blocks_global), (c + steps - 1) // bs + 1)}
            if window:
                last = kv.first_needed(c + steps - 1)
                at.update(max(1, (j + 1) * bs + window - c) for j in range(seq.local_start, last))
            events.extend((k, index) for k in at)
        events.sort()
        origin = [seq.computed for seq in seqs]
        for k, index in events:
            seq = seqs[index]
            seq.computed = origin[index] + k - 1
            kv.register(seq, seq.computed // bs)
            allocated = kv.allocate(seq, seq.computed + 1)
            assert allocated, "the span's growth fits by construction"
        for seq, c in zip(seqs, origin, strict=True):
            seq.computed = c + steps
            kv.register(seq, seq.computed // bs)

    def _commit_decode(self, span: DecodeSpan, steps: int, start: float) -> None:
        stats = self.stats
        batch = len(span.seqs)
        end = start + span.ends[steps - 1]
        first = start + span.ends[0]
        stats.steps += steps
        stats.generation_tokens += batch * steps
        for k in range(1, steps):
            stats.itl.observe(span.ends[k] - span.ends[k - 1], batch)
        self._span_blocks(span.seqs, steps)
        observe = stats.itl.observe
        for seq in span.seqs:
            observe(first - seq.last_token_at)
            seq.generated += steps
            seq.last_token_at = end
        for seq in span.seqs:
            if seq.generated >= seq.target:
                self._finish(seq, end)
            else:
                seq.notify(False)


def draw_output_length(spec: OutputLengths, rng: random.Random) -> int:
    """Where the simulated model emits EOS, when the request lets it."""
    if spec.distribution == "fixed":
        return spec.value  # type: ignore[return-value]
    if spec.distribution == "uniform":
        return rng.randint(spec.low, spec.high)  # type: ignore[arg-type]
    return max(1, round(spec.median * math.exp(spec.sigma * rng.gauss(0.0, 1.0))))  # type: ignore[operator]


class Engine:
    """A scheduler paced against the wall clock; one per simulated replica.

    `run()` is the step loop (a background task for the replica's lifetime). Handlers call
    `submit` and `abort`; both wake the loop so that a decode span in flight is cut at the
    step under way.
    """

    def __init__(
        self,
        profile: Profile,
        *,
        time_scale: float = 1.0,
        stream_interval_s: float = 0.0,
        fast_forward: bool = True,
        enable_prefix_caching: bool = True,
        seed: int = 0,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.profile = profile
        self.scheduler = Scheduler(
            profile, fast_forward=fast_forward, enable_prefix_caching=enable_prefix_caching
        )
        self.time_scale = time_scale
        self.stream_interval_s = stream_interval_s
        # A span never outlasts one stream interval: that is the granularity clients see anyway.
        self._span_cap_s = stream_interval_s * time_scale
        self._rng = random.Random(seed)
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wall0 = 0.0
        self._clock = 0.0  # simulated time at the end of the last committed step
        self._inflight: tuple[float, float] | None = None  # (start, duration) of the plan asleep
        self._wakeup: asyncio.Future[None] | None = None
        self._woken_at: float | None = None
        self._aborts: list[Sequence] = []
        self._stalled_until = 0.0
        self.slip_s = 0.0
        self._publisher: KVEventPublisher | None = None

    def publish_kv_events(self, publisher: KVEventPublisher) -> None:
        """Record the cache's events from now on, and publish them after each step."""
        self._publisher = publisher
        self.scheduler.kv.events = []

    # -- what the server and the metrics read -----------------------------------------------

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_usage

    def now(self) -> float:
        """Simulated time, never beyond the end of the step under way."""
        if self._loop is None:
            return self._clock
        wall = (self._loop.time() - self._wall0) * self.time_scale
        if self._inflight is not None:
            start, duration = self._inflight
            return min(max(wall, start), start + duration)
        return max(wall, self._clock)

    # -- what handlers do -------------------------------------------------------------------

    def submit(
        self,
        prompt: int | PromptIds,
        max_tokens: int,
        *,
        ignore_eos: bool,
    ) -> Sequence:
        """Queue a request: its token ids, or only their count (a prompt nothing shares).

        Without `ignore_eos` its output length is drawn from the profile.
        """
        target = max_tokens
        if not ignore_eos:
            target = min(max_tokens, draw_output_length(self.profile.output_lengths, self._rng))
        ids = None if isinstance(prompt, int) else prompt
        count = prompt if isinstance(prompt, int) else len(prompt)
        seq = Sequence(next(self._ids), count, max_tokens, target, ids)
        seq.arrival = self.now()
        self.scheduler.waiting.append(seq)
        if self.num_running < self.scheduler.max_seqs:  # else it cannot join before a finish
            self._wake()
        return seq

    def abort(self, seq: Sequence) -> None:
        """Free `seq` at the next step boundary (the engine owns the scheduler's state)."""
        if not seq.done:
            self._aborts.append(seq)
            self._wake()

    def stall(self, seconds: float) -> None:
        """Pause stepping for `seconds` of simulated time, from the end of the step under way."""
        self._stalled_until = max(self._stalled_until, self.now() + seconds)
        self._wake()

    # -- the loop ---------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._woken_at = self.now()
            self._wakeup.set_result(None)

    async def _wait(self, delay: float | None) -> float | None:
        """Sleep `delay` wall seconds (None: until woken); the simulated time if woken."""
        assert self._loop is not None
        self._wakeup = fut = self._loop.create_future()
        self._woken_at = None
        timer = None if delay is None else self._loop.call_later(delay, _resolve, fut)
        try:
            await fut
        finally:
            self._wakeup = None
            if timer is not None:
                timer.cancel()
        return self._woken_at

    async def _sleep_until(self, target: float, *, splittable: bool) -> float | None:
        """Until simulated time `target`; returns the wake-up time if woken and `splittable`.

        Each pass either returns or waits on a timer, so the loop is bounded by wake-ups.
        """
        assert self._loop is not None
        while True:
            delay = self._wall0 + target / self.time_scale - self._loop.time()
            if delay < MIN_SLEEP_S:
                if delay < -SLIP_TOLERANCE_S:  # behind: let simulated time slip, do not race
                    self._wall0 -= delay
                    self.slip_s -= delay * self.time_scale
                await asyncio.sleep(0)  # handlers run between back-to-back steps
                return None
            woken = await self._wait(delay)
            if woken is not None and splittable:
                return woken

    def _drain_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        for seq in aborts:
            self.scheduler.abort(seq)

    async def run(self) -> None:
        """The step loop; runs until cancelled. A crash aborts every request it holds."""
        self._loop = asyncio.get_running_loop()
        self._wall0 = self._loop.time() - self._clock / self.time_scale
        try:
            await self._steps()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("simulated engine crashed; aborting its requests")
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                self.scheduler.abort(seq)
            raise

    async def _steps(self) -> None:
        scheduler = self.scheduler
        while True:  # until cancelled; every pass sleeps, yields, or waits to be woken
            self._drain_aborts()
            if self._stalled_until > self._clock:
                self._inflight = (self._clock, self._stalled_until - self._clock)
                woken = await self._sleep_until(self._stalled_until, splittable=True)
                self._inflight = None
                self._clock = self._stalled_until if woken is None else woken
                continue
            plan = scheduler.plan(self._clock, self._span_cap_s) if scheduler.has_work() else None
            if plan is None:
                await self._wait(None)
                self._clock = self.now()
                continue
            start, duration = self._clock, plan.end(plan.steps)
            self._inflight = (start, duration)
            woken = await self._sleep_until(start + duration, splittable=plan.steps > 1)
            self._inflight = None
            steps = plan.steps if woken is None else plan.steps_through(woken - start)
            self._clock = start + plan.end(steps)
            scheduler.commit(plan, steps, start)
            kv = scheduler.kv
            if kv.events and self._publisher is not None:
                self._publisher.publish(kv.events)
                kv.events = []
