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
        endpoint: chat             # or completions, messages (Anthropic's), responses (OpenAI's
                                   # Responses API), embeddings (prefill only)
        isl: {type: normal, mean: 4000, std: 300, min: 1000}
        osl: 10                    # a bare number is {type: fixed, value: N}
      - name: generation
        isl: {type: lognormal, median: 500, sigma: 0.4, max: 8000}
        osl: {type: empirical, values: [200, 800, 1000, 1000, 1500]}

Two class options make requests share prefixes, as production traffic does (docs/loadgen.md):

      - name: classification       # one of K rule sets of R tokens first, then unique product text
        isl: 4000
        osl: 10
        rules: {sets: 8, tokens: 3000, pick: zipf, zipf_s: 1.1}
      - name: chat                 # each arrival starts a session; each turn resends the history
        isl: 200                   # the new user message, tokens
        osl: 150
        session: {turns: 5, think_s: 1.0}

Without either option no two requests share a prefix: the existing workloads are the "no shared
prefix" case.

Two more say what a request asks of an SLO-admitting gateway (docs/loadgen.md, "Objectives"):

      - name: generation
        isl: 500
        osl: 1000
        priority: {standard: 0.7, sheddable: 0.3}   # x-priority, drawn per request (or one tier)
        slo: {ttft_ms: 2000, tpot_ms: 50}            # x-slo-ttft-ms / x-slo-tpot-ms, simulated ms
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from gateway.config.schema import Tier

Endpoint = Literal["chat", "completions", "messages", "responses", "embeddings"]


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


def lowest(dist: Fixed | Normal | LogNormal | Empirical) -> int:
    """The smallest token count a distribution can draw."""
    if isinstance(dist, Fixed):
        return dist.value
    if isinstance(dist, Empirical):
        return min(dist.values)
    return dist.min


class RuleSets(Spec):
    """K rule sets of exactly R tokens: every request starts with one, verbatim, as the seed
    article's classification prompt starts with the product rules; the product text follows."""

    sets: int = Field(ge=1, description="K: how many distinct rule sets.")
    tokens: int = Field(ge=1, description="R: each rule set's exact length in tokens.")
    pick: Literal["uniform", "zipf"] = "uniform"
    zipf_s: float = Field(
        1.0, gt=0, description="zipf: set k (from 0) is picked with weight 1 / (k + 1)^s."
    )

    def weights(self) -> list[float]:
        if self.pick == "uniform":
            return [1.0] * self.sets
        return [1.0 / (k + 1) ** self.zipf_s for k in range(self.sets)]


class Session(Spec):
    """A multi-turn conversation: each turn sends the whole history plus a new user message
    (the class's `isl` tokens) and waits for its answer (`osl` tokens) before the next."""

    turns: Distribution = Field(description="Turns per session.")
    think_s: float = Field(
        0.0, ge=0, description="Wall-clock pause between an answer and the next turn."
    )


class ClassSlo(Spec):
    """A class's latency objectives in simulated milliseconds: sent as `x-slo-ttft-ms` /
    `x-slo-tpot-ms` (over the run's time scale, as the gateway measures wall time) and held
    against what the client observed when goodput is counted."""

    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _not_empty(self) -> ClassSlo:
        if self.ttft_ms is None and self.tpot_ms is None:
            raise ValueError("give ttft_ms, tpot_ms or both")
        return self


def _one_tier_is_all(value: Any) -> Any:
    return {value: 1.0} if isinstance(value, str) else value


Priorities = Annotated[
    dict[Tier, Annotated[float, Field(gt=0)]],
    Field(min_length=1),
    BeforeValidator(_one_tier_is_all),
]


class WorkloadClass(Spec):
    name: str = Field(min_length=1)
    weight: float = Field(1.0, gt=0, description="Share of requests, relative to the others.")
    endpoint: Endpoint = "chat"
    isl: Distribution = Field(description="Input tokens; in a session, the new message's.")
    osl: Distribution
    rules: RuleSets | None = None
    session: Session | None = None
    priority: Priorities | None = Field(
        None, description="`x-priority`: one tier, or tiers with weights drawn per request."
    )
    slo: ClassSlo | None = None

    @model_validator(mode="after")
    def _prefix_fits(self) -> WorkloadClass:
        if self.rules and self.session:
            raise ValueError("a class has rules or a session, not both")
        if self.rules and lowest(self.isl) <= self.rules.tokens:
            raise ValueError(
                f"isl can draw {lowest(self.isl)}, not more than the rule set's"
                f" {self.rules.tokens} tokens: the product text needs room"
            )
        if self.session and self.endpoint == "completions":
            raise ValueError("a session is a conversation: endpoint must be chat or messages")
        return self


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
        """Every class on `endpoint`, validated: a session cannot move to completions."""
        classes = [c.model_dump() | {"endpoint": endpoint} for c in self.classes]
        return Workload.model_validate(self.model_dump() | {"classes": classes})


CLASSIFICATION = WorkloadClass(name="classification", isl=Fixed(value=4000), osl=Fixed(value=10))
GENERATION = WorkloadClass(name="generation", isl=Fixed(value=500), osl=Fixed(value=1000))
# An agent on Anthropic's /v1/messages: conversations of 6 turns, each a 300-token message
# (a tool result, an instruction) on the whole history, 150 tokens back; and one-off 2,000-token
# tool-planning calls, 40 back, at half the rate.
AGENT = Workload(
    name="agent",
    classes=[
        WorkloadClass(
            name="agent-turns", endpoint="messages", isl=Fixed(value=300), osl=Fixed(value=150),
            session=Session(turns=Fixed(value=6)),
        ),
        WorkloadClass(
            name="agent-calls", endpoint="messages", weight=0.5, isl=Fixed(value=2000),
            osl=Fixed(value=40),
        ),
    ],
)  # fmt: skip
# Retrieval: embedding requests (the chunks of a RAG index, a query), prefill-only work on the
# pooling endpoint; `osl` is not sent (an embedding has no output), only a positive placeholder.
RETRIEVAL = WorkloadClass(
    name="retrieval", endpoint="embeddings", isl=Fixed(value=512), osl=Fixed(value=1)
)
# One fleet serving all four (`make demo`): of 1.5 arrivals a second, classification and
# generation 0.6 each, retrieval 0.2, agent calls 0.08 and agent conversations 0.02 (0.12 turns).
_AGENT_TURNS, _AGENT_CALLS = AGENT.classes
PLATFORM = Workload(
    name="platform",
    classes=[
        CLASSIFICATION.model_copy(update={"weight": 0.6}),
        GENERATION.model_copy(update={"weight": 0.6}),
        RETRIEVAL.model_copy(update={"weight": 0.2}),
        _AGENT_CALLS.model_copy(update={"weight": 0.08}),
        _AGENT_TURNS.model_copy(update={"weight": 0.02}),
    ],
)
# The article's two classes with objectives, for SLO admission (docs/capacity.md, "SLO
# admission"): classification is business-critical or standard and asks for its answer (10
# tokens: TTFT is nearly all of it) within 1.5 s; generation asks TTFT 2 s and TPOT 50 ms, and
# a third of it is sheddable (a batch job's, say). Its bursts come from the trace
# (`bursts:` in loadtest/autoscale/trace.py), not from the workload.
SLO_MIXED = Workload(
    name="slo-mixed",
    classes=[
        CLASSIFICATION.model_copy(
            update={
                "priority": {"critical": 0.4, "standard": 0.6},
                "slo": ClassSlo(ttft_ms=1500),
            }
        ),
        GENERATION.model_copy(
            update={
                "priority": {"standard": 2 / 3, "sheddable": 1 / 3},
                "slo": ClassSlo(ttft_ms=2000, tpot_ms=50),
            }
        ),
    ],
)
BUILTIN: dict[str, Workload] = {
    "classification": Workload(name="classification", classes=[CLASSIFICATION]),
    "generation": Workload(name="generation", classes=[GENERATION]),
    "mixed": Workload(name="mixed", classes=[CLASSIFICATION, GENERATION]),
    "agent": AGENT,
    "retrieval": Workload(name="retrieval", classes=[RETRIEVAL]),
    "platform": PLATFORM,
    "slo-mixed": SLO_MIXED,
}


# Shared-prefix workloads named on the command line: K rule sets x R tokens (classification's
# 4,000 in / 10 out), or sessions of N turns x M-token messages (150 out per turn).
RULES_NAME = re.compile(r"rules-(\d+)x(\d+)(?:-zipf(\d+(?:\.\d+)?))?")
SESSIONS_NAME = re.compile(r"sessions-(\d+)x(\d+)(?:-think(\d+(?:\.\d+)?))?")
NAMED = "rules-KxR[-zipfS], sessions-NxM[-thinkS]"


def named_workload(name: str) -> Workload | None:
    """`rules-8x3000`, `rules-64x3000-zipf1.1`, `sessions-5x200`, `sessions-5x200-think2`."""
    if m := RULES_NAME.fullmatch(name):
        tokens, zipf = int(m[2]), m[3]
        pick = {"pick": "zipf", "zipf_s": float(zipf)} if zipf else {}
        rules = RuleSets.model_validate({"sets": int(m[1]), "tokens": tokens, **pick})
        isl = Fixed(value=max(lowest(CLASSIFICATION.isl), tokens + 1000))
        cls = WorkloadClass(name="classification", isl=isl, osl=CLASSIFICATION.osl, rules=rules)
        return Workload(name=name, classes=[cls])
    if m := SESSIONS_NAME.fullmatch(name):
        session = Session(turns=Fixed(value=int(m[1])), think_s=float(m[3] or 0))
        cls = WorkloadClass(
            name="chat", isl=Fixed(value=int(m[2])), osl=Fixed(value=150), session=session
        )
        return Workload(name=name, classes=[cls])
    return None


def load_workload(spec: str | Path) -> Workload:
    """A built-in workload by name (or a shared-prefix one, see `named_workload`), or a YAML file."""
    if str(spec) in BUILTIN:
        return BUILTIN[str(spec)]
    if named := named_workload(str(spec)):
        return named
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(
            f"workload {str(spec)!r} is neither a file nor one of {', '.join(BUILTIN)}, {NAMED}"
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
    """One request of a plan: its class, shape, and (open loop) arrival offset in seconds.

    With rules, `rule_set` is the index of the class's rule set it starts with (`rule_tokens`
    long). In a session, `session` numbers the plan's sessions and `turn` the request's place in
    it; only turn 0 has an arrival, the next turn follows its answer after `think_s`, and `isl`
    is the new message's length (the whole prompt's is known only once the history is)."""

    cls: str
    endpoint: Endpoint
    isl: int
    osl: int
    at: float | None = None
    rule_set: int | None = None
    rule_tokens: int = 0
    session: int | None = None
    turn: int = 0
    think_s: float = 0.0
    priority: Tier | None = None
    slo: ClassSlo | None = None


def _priority(c: WorkloadClass, rng: random.Random) -> Tier | None:
    """The class's tier; a draw only when it has several, so other plans stay as they were."""
    if c.priority is None:
        return None
    tiers = list(c.priority)
    if len(tiers) == 1:
        return tiers[0]
    (tier,) = rng.choices(tiers, weights=list(c.priority.values()))
    return tier


def plan(
    workload: Workload, count: int, rng: random.Random, arrivals: list[float] | None = None
) -> list[Planned]:
    """`count` arrivals drawn from the workload's mix; `arrivals`, if given, sets their times.

    An arrival of a session class is a whole session, expanded here into its turns. Draws for
    rules and sessions happen only for such classes, so other workloads plan as they always did."""
    weights = [c.weight for c in workload.classes]
    picks = rng.choices(workload.classes, weights=weights, k=count)
    times: list[float | None] = list(arrivals) if arrivals is not None else [None] * count
    out: list[Planned] = []
    for number, (c, at) in enumerate(zip(picks, times, strict=True)):
        if c.session is not None:
            turns = c.session.turns.sample(rng)
            for turn in range(turns):
                isl, osl = c.isl.sample(rng), c.osl.sample(rng)
                out.append(
                    Planned(
                        c.name,
                        c.endpoint,
                        isl,
                        osl,
                        at if turn == 0 else None,
                        session=number,
                        turn=turn,
                        think_s=c.session.think_s,
                        priority=_priority(c, rng),
                        slo=c.slo,
                    )
                )
            continue
        planned = Planned(c.name, c.endpoint, c.isl.sample(rng), c.osl.sample(rng), at)
        if c.priority is not None or c.slo is not None:
            planned = replace(planned, priority=_priority(c, rng), slo=c.slo)
        if c.rules is not None:
            (index,) = rng.choices(range(c.rules.sets), weights=c.rules.weights())
            planned = replace(planned, rule_set=index, rule_tokens=c.rules.tokens)
        out.append(planned)
    return out


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
