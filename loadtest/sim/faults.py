"""Fault injection: what a replica does wrong, set at start (`--faults`) or at run time.

A fault set is one JSON object; setting one replaces the previous set (`{}` clears them).
Durations are simulated seconds, like everything the simulator reports (wall seconds times
the time scale); fractions are per request, drawn from the replica's seeded generator.

- `error_rate` / `error_status`: that fraction of generation requests is answered at once with
  HTTP 500 or 503 in vLLM's error shape, before any engine work.
- `stall_s`: the engine stops stepping for that long from when the set is applied (after the
  step under way); requests keep arriving and queueing, streams go silent.
- `first_token_delay_s`: every request waits that long before it reaches the engine, so its
  first token (and, for non-streaming requests, its whole answer) is that much later.
- `reset_after_chunks` / `reset_rate`: that fraction of streams has its connection aborted
  (no final chunk, no `[DONE]`) after that many SSE chunks; the sequence is aborted too.
- `refuse_for_s`: the replica stops listening for that long (new connections are refused,
  open ones continue), then listens again on the same port. Only for a replica whose listener
  the simulator owns (`start_replica`, the CLI); the admin endpoint cannot be reached while it
  lasts, which is why it always has a duration.
"""

from __future__ import annotations

import random
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Fraction = Annotated[float, Field(ge=0, le=1)]
Seconds = Annotated[float, Field(ge=0)]


class Faults(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    error_rate: Fraction = 0.0
    error_status: Literal[500, 503] = 500
    stall_s: Seconds = 0.0
    first_token_delay_s: Seconds = 0.0
    reset_after_chunks: Annotated[int, Field(ge=0)] | None = None
    reset_rate: Fraction = 1.0
    refuse_for_s: Seconds = 0.0


class FaultDice:
    """Per-request draws for the probabilistic faults, from one seeded generator."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def error(self, faults: Faults) -> int | None:
        """The status to fail this request with, or None."""
        if faults.error_rate and self._rng.random() < faults.error_rate:
            return faults.error_status
        return None

    def reset_after(self, faults: Faults) -> int | None:
        """After how many chunks this stream's connection is aborted, or None."""
        if faults.reset_after_chunks is None or self._rng.random() >= faults.reset_rate:
            return None
        return faults.reset_after_chunks
