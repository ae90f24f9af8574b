"""Workloads: which request shapes a load test sends, as ISL / OSL distributions per class.

A workload is a mix of classes, each with an input-length (ISL) and an output-length (OSL)
distribution and a weight. The built-ins are the article's two compute problems — classification
(prefill-heavy, 4,000 in / 10 out) and generation (decode-heavy, 500 in / 1,000 out) — and their
even mix; anything else comes from a YAML file, usually one `llm-loadtest profile` wrote from a
gateway's access log:

    name: production
    users: [12, 40, 75]            # optional: closed-loop levels to sweep (profile: observed P50/P95/P99)
    classes:
      - name: classification
        weight: 3
        endpoint: chat             # or completions
        isl: {type: normal, mean: 4000, std: 300, min: 1000}
        osl: 10                    # a bare number is {type: fixed, value: N}
      - name: generation
        isl: {type: lognormal, median: 500, sigma: 0.4, max: 8000}
        osl: {type: empirical, values: [200, 800, 1000, 1000, 1500]}
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

Endpoint = Literal["chat", "completions"]


class Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Bounded(Spec):
    """Continuous distributions are rounded and clamped: a token count is a positive integer."""

    min: int = Field(1, ge=1)
    max: int | None = Field(None, ge=1)

    def _clamp(self, value: float) -> int:
        tokens = max(self.min, round(value))
        return tokens if self.max is None else min(self.max, tokens)


class Fixed(Spec):
    type: Literal["fixed"] = "fixed"
    value: int = Field(ge=1)

    def sample(self, rng: random.Random) -> int:
        return self.value


class Normal(_Bounded):
    type: Literal["normal"] = "normal"
    mean: float = Field(gt=0)
    std: float = Field(ge=0)

    def sample(self, rng: random.Random) -> int:
        return self._clamp(rng.gauss(self.mean, self.std))


class LogNormal(_Bounded):
    """Parameterised by its median (`exp(mu)`), which reads like a token count, and `sigma`."""

    type: Literal["lognormal"] = "lognormal"
    median: float = Field(gt=0)
    sigma: float = Field(ge=0)

    def sample(self, rng: random.Random) -> int:
        return self._clamp(rng.lognormvariate(math.log(self.median), self.sigma))


class Empirical(Spec):
    """Observed values, drawn uniformly: a value's frequency in the list is its probability."""

    type: Literal["empirical"] = "empirical"
    values: list[Annotated[int, Field(ge=1)]] = Field(min_length=1)

    def sample(self, rng: random.Random) -> int:
        return rng.choice(self.values)


def _bare_number_is_fixed(value: Any) -> Any:
    return {"type": "fixed", "value": value} if isinstance(value, int) else value


Distribution = Annotated[
    Fixed | Normal | LogNormal | Empirical,
    Field(discriminator="type"),
    BeforeValidator(_bare_number_is_fixed),
]


class WorkloadClass(Spec):
    name: str = Field(min_length=1)
    weight: float = Field(1.0, gt=0, description="Share of requests, relative to the others.")
    endpoint: Endpoint = "chat"
    isl: Distribution
    osl: Distribution


class Workload(Spec):
    name: str = Field(min_length=1)
    classes: list[WorkloadClass] = Field(min_length=1)
    users: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, description="Closed-loop levels a sweep uses when none are given on its command line."
    )
    source: dict[str, Any] = Field(
        {}, description="Provenance, for people: what `profile` measured. Sweeps ignore it."
    )

    @model_validator(mode="after")
    def _distinct_names(self) -> Workload:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"class names must be distinct: {names}")
        return self

    def with_endpoint(self, endpoint: Endpoint) -> Workload:
        classes = [c.model_copy(update={"endpoint": endpoint}) for c in self.classes]
        return self.model_copy(update={"classes": classes})


CLASSIFICATION = WorkloadClass(name="classification", isl=Fixed(value=4000), osl=Fixed(value=10))
GENERATION = WorkloadClass(name="generation", isl=Fixed(value=500), osl=Fixed(value=1000))
BUILTIN: dict[str, Workload] = {
    "classification": Workload(name="classification", classes=[CLASSIFICATION]),
    "generation": Workload(name="generation", classes=[GENERATION]),
    "mixed": Workload(name="mixed", classes=[CLASSIFICATION, GENERATION]),
}


def load_workload(spec: str | Path) -> Workload:
    """A built-in workload by name, or a workload YAML file."""
    if str(spec) in BUILTIN:
        return BUILTIN[str(spec)]
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(
            f"workload {str(spec)!r} is neither a file nor one of {', '.join(BUILTIN)}"
        )
    raw = yaml.safe_load(path.read_text())
    if isinstance(raw, dict):
        raw.setdefault("name", path.stem)
    return Workload.model_validate(raw)


class _Dumper(yaml.SafeDumper):
    """Lists and mappings of plain values on one line: an empirical list stays readable."""


def _flat(values: Any) -> bool:
    return all(v is None or isinstance(v, int | float | str) for v in values)


def _sequence(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=_flat(data))


def _mapping(dumper: yaml.SafeDumper, data: dict[str, Any]) -> yaml.Node:
    flow = _flat(data.values()) and "values" not in data  # a distribution keeps its own lines
    return dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=flow)


_Dumper.add_representer(list, _sequence)
_Dumper.add_representer(dict, _mapping)


def dump_workload(workload: Workload, path: str | Path) -> Path:
    path = Path(path)
    data = workload.model_dump(mode="json", exclude_none=True)
    path.write_text(yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100))
    return path


@dataclass(frozen=True, slots=True)
class Planned:
    """One request of a plan: its class, shape, and (open loop) arrival offset in seconds."""

    cls: str
    endpoint: Endpoint
    isl: int
    osl: int
    at: float | None = None


def plan(
    workload: Workload, count: int, rng: random.Random, arrivals: list[float] | None = None
) -> list[Planned]:
    """`count` requests drawn from the workload's mix; `arrivals`, if given, sets their times."""
    weights = [c.weight for c in workload.classes]
    picks = rng.choices(workload.classes, weights=weights, k=count)
    times: list[float | None] = list(arrivals) if arrivals is not None else [None] * count
    return [
        Planned(c.name, c.endpoint, c.isl.sample(rng), c.osl.sample(rng), at)
        for c, at in zip(picks, times, strict=True)
    ]


def poisson_arrivals(
    rate: float, duration_s: float, rng: random.Random, limit: int | None
) -> list[float]:
    """Arrival offsets of a Poisson process at `rate`/s within `duration_s`, at most `limit`."""
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s and (limit is None or len(times) < limit):
        times.append(t)
        t += rng.expovariate(rate)
    return times
