"""How long one engine step takes: a roofline over the step's work.

A step runs every scheduled token through the model once. Its time is the larger of

- compute: 2 FLOP per weight per token (the matmuls), 2 per head weight per sampled sequence
  (the output head runs only where a token is sampled), and attention's 4 FLOP per query-key
  pair per head dimension (QK^T and AV), over peak FLOP/s x compute efficiency;
- memory: every weight read once per step (that is why decode is memory bound and batching
  pays), plus each sequence's KV cache read once and the new tokens' KV written, over HBM
  bandwidth x memory efficiency;

plus a fixed per-step overhead (scheduler, launch, sampling, host sync) that no batch hides.
Local (sliding-window) layers attend to, and read, at most `window` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadtest.sim.profiles import Profile


def capped_sum(first: int, last: int, cap: int) -> int:
    """sum(min(x, cap) for x in range(first, last + 1)), in O(1); 0 when last < first."""
    if last < first:
        return 0
    if cap <= 0 or last <= cap:
        return (first + last) * (last - first + 1) // 2
    if first > cap:
        return cap * (last - first + 1)
    return (first + cap) * (cap - first + 1) // 2 + cap * (last - cap)


@dataclass(slots=True)
class BatchShape:
    """What a step does, summed over its sequences (per layer of each kind)."""

    tokens: int = 0  # scheduled tokens: decode tokens plus prefill chunks
    sampled: int = 0  # sequences that sample a token at the end of the step
    pairs_global: int = 0  # query-key pairs in one global layer
    pairs_local: int = 0  # in one local layer (window-capped)
    kv_global: int = 0  # KV tokens read by one global layer
    kv_local: int = 0  # by one local layer

    def add(self, computed: int, new: int, samples: bool, window: int) -> None:
        """One sequence's chunk: `new` tokens after `computed` already in the cache."""
        end = computed + new
        self.tokens += new
        self.sampled += samples
        if new == 1:  # a decode token: the common case, without the general sums
            self.pairs_global += end
            self.kv_global += end
            if window:
                local = end if end < window else window
                self.pairs_local += local
                self.kv_local += local
            return
        self.pairs_global += capped_sum(computed + 1, end, 0)
        self.kv_global += end
        if window:
            self.pairs_local += capped_sum(computed + 1, end, window)
            self.kv_local += min(end, window)


class Roofline:
    """Step times for one profile; constants folded once because the engine calls it per step."""

    __slots__ = (
        "_bytes_per_kv_token_global",
        "_bytes_per_kv_token_local",
        "_bytes_per_new_token",
        "_compute_rate",
        "_flops_per_pair_global",
        "_flops_per_pair_local",
        "_flops_per_sample",
        "_flops_per_token",
        "_memory_rate",
        "_weight_bytes",
        "overhead_s",
    )

    def __init__(self, profile: Profile) -> None:
        model, hw = profile.model, profile.hardware
        per_pair = 4 * model.num_attention_heads * model.head_dim
        kv = model.kv_bytes_per_layer_token
        self._flops_per_token = 2 * model.layer_params
        self._flops_per_sample = 2 * model.embedding_params
        self._flops_per_pair_global = per_pair * model.global_layers
        self._flops_per_pair_local = per_pair * model.local_layers
        # The vision tower sits in HBM but a text step never reads it.
        self._weight_bytes = (model.layer_params + model.embedding_params) * model.dtype_bytes
        self._bytes_per_kv_token_global = kv * model.global_layers
        self._bytes_per_kv_token_local = kv * model.local_layers
        self._bytes_per_new_token = kv * model.num_layers
        self._compute_rate = hw.chips * hw.peak_flops_per_chip * hw.compute_efficiency
        self._memory_rate = hw.chips * hw.hbm_bandwidth_per_chip * hw.memory_efficiency
        self.overhead_s = hw.step_overhead_s

    def _terms(
        self, tokens: int, sampled: int, pairs_g: int, pairs_l: int, kv_g: int, kv_l: int
    ) -> tuple[float, float]:
        flops = (
            self._flops_per_token * tokens
            + self._flops_per_sample * sampled
            + self._flops_per_pair_global * pairs_g
            + self._flops_per_pair_local * pairs_l
        )
        moved = (
            self._weight_bytes
            + self._bytes_per_kv_token_global * kv_g
            + self._bytes_per_kv_token_local * kv_l
            + self._bytes_per_new_token * tokens
        )
        return flops / self._compute_rate, moved / self._memory_rate

    def terms(self, shape: BatchShape) -> tuple[float, float]:
        """(compute seconds, memory seconds) of a step, without overhead: which one binds."""
        return self._terms(
            shape.tokens,
            shape.sampled,
            shape.pairs_global,
            shape.pairs_local,
            shape.kv_global,
            shape.kv_local,
        )

    def step_time(self, shape: BatchShape) -> float:
        return max(self.terms(shape)) + self.overhead_s

    def decode_time(self, batch: int, context_global: int, context_local: int) -> float:
        """A pure decode step: `batch` sequences, one token each, attending to the given sums.

        For one decode token the query-key pairs equal the KV tokens read, so the sums serve
        both; this is `step_time` without building a shape, for the engine's fast path.
        """
        compute, memory = self._terms(
            batch, batch, context_global, context_local, context_global, context_local
        )
        return max(compute, memory) + self.overhead_s
