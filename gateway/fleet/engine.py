"""What a replica's engine says of its load, read from its Prometheus exposition.

The series names are data (`EngineMetrics`): vLLM's are the default, and an engine that exports
the same figures under other names needs a new `EngineMetrics`, not new parsing code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gateway.admit.replica import EngineGauges


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """The names of the series an engine exports for what the scorers weigh: its requests
    running and waiting, its KV cache in use (0..1), and its prompt tokens so far."""

    running: str
    waiting: str
    kv_cache_usage: str
    prompt_tokens: str

    @property
    def families(self) -> tuple[str, ...]:
        return (self.running, self.waiting, self.kv_cache_usage, self.prompt_tokens)


# vLLM's names (vllm/v1/metrics/loggers.py); labelled by `model_name`.
VLLM = EngineMetrics(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_cache_usage="vllm:kv_cache_usage_perc",
    prompt_tokens="vllm:prompt_tokens_total",
)


def read_engine(exposition: str, model: str, names: EngineMetrics = VLLM) -> EngineGauges | None:
    """The engine figures in a Prometheus text; None when it has neither request count.

    A line scan rather than a full parse: vLLM's exposition is mostly histogram buckets this
    does not need, and with scorers it is read every second from every replica."""
    families = names.families
    sums = dict.fromkeys(families, 0.0)
    found: set[str] = set()
    kv: float | None = None
    ours = f'model_name="{model}"'
    for line in exposition.splitlines():
        if not line.startswith(families):
            continue
        name, brace, rest = line.partition("{")
        if brace:
            labels, _, rest = rest.partition("}")
            if "model_name=" in labels and ours not in labels:
                continue
        else:
            name, _, rest = line.partition(" ")
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        name = name.strip()
        if name not in sums:
            continue  # a longer family name with one of ours as its prefix
        found.add(name)
        sums[name] += value
        if name == names.kv_cache_usage:
            kv = value if kv is None else max(kv, value)
    if not found & {names.running, names.waiting}:
        return None
    return EngineGauges(
        round(sums[names.running]),
        round(sums[names.waiting]),
        kv,
        sums[names.prompt_tokens] if names.prompt_tokens in found else None,
        time.monotonic(),
    )
