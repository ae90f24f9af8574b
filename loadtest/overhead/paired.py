"""(a) at one connection, the targets side by side: a `loadtest.paired_latency` run in a child.

wrk's one-connection runs come one after another while the machine's speed drifts, and the
verdict is a quotient of differences of p50s (`added_ratio`); measuring the targets in
alternating blocks lets them all see the same machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.overhead.fleet import ROOT, CpuMeter, Service


@dataclass
class Paired:
    """One `loadtest.paired_latency` run: each target's one-connection p50, side by side."""

    shape: str  # how `loadtest.paired_latency` measured, in words
    p50_ms: dict[str, float | None]
    requests: int
    errors: int
    other_cores: float

    def added(self, name: str = "gateway") -> float | None:
        """What `name` adds to direct's p50, over what the pass-through adds."""
        return added_ratio(*(self.p50_ms.get(t) for t in ("direct", "pass-through", name)))


def added_ratio(direct: float | None, base: float | None, other: float | None) -> float | None:
    """(other - direct) / (base - direct): the latency `other` adds in units of what `base` adds;
    None when a figure is missing or `base` adds nothing."""
    if direct is None or base is None or other is None or base <= direct:
        return None
    return (other - direct) / (base - direct)


def measure_paired(
    targets: Mapping[str, Service], services: Sequence[Service], body: Path
) -> Paired:
    """The short request at one connection, `targets` (direct, the pass-through and one or more
    gateways) in alternating blocks; "other CPU" is what nothing of `services` used."""
    argv = [sys.executable, "-m", "loadtest.paired_latency", "--body", str(body)]
    argv += [f"{name}={service.port}" for name, service in targets.items()]
    with CpuMeter(targets["direct"], services) as cpu:
        out = subprocess.run(
            argv, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False
        )
    if out.returncode != 0:
        raise RuntimeError(f"paired latency client failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout)
    data = result["targets"]
    return Paired(
        shape=result["shape"],
        p50_ms={name: data[name]["p50_ms"] for name in targets},
        requests=min(data[name]["requests"] for name in targets),
        errors=sum(data[name]["errors"] for name in targets),
        other_cores=cpu.other_cores,
    )
