"""The policy file's shape: pydantic models, frozen, unknown keys forbidden.

These models only describe and validate what the operator wrote. `compile.py` turns a validated
`PolicySpec` into the runtime `Policy` (tokenizers loaded, predicates built, plug-ins made) once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# An endpoint's name (`match.endpoint`): one of the APIs gateway/api/ registers, checked when
# the policy is compiled, as a plug-in's type is; this layer is below the registry.
Endpoint = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")]
Tier = Literal["critical", "standard", "sheddable"]
PRIORITIES: tuple[str, ...] = ("critical", "standard", "sheddable")
"""Queue priorities, highest first: a tenant's tier, which `x-priority` may lower."""


class Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0)]
# vLLM's request `priority` is an int64 (vllm/entrypoints/openai/chat_completion/protocol.py).
VllmInt = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# A request's `model` is at most 256 characters (api/fields.py, MAX_MODEL_CHARS): a longer adapter name
# could never be asked for.
AdapterName = Annotated[str, Field(min_length=1, max_length=256)]


class Range(Spec):
    """A numeric bound: every given side must hold."""

    gte: float | None = None
    gt: float | None = None
    lte: float | None = None
    lt: float | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> Range:
        if self.gte is None and self.gt is None and self.lte is None and self.lt is None:
            raise ValueError("give at least one of gte, gt, lte, lt")
        return self


COUNT_BY_CHARS = (
    "estimate"  # a model's `tokenizer` when it is counted by characters, not a tokenizer
)


class ModelSpec(Spec):
    tokenizer: str = Field(
        description="Local Hugging Face tokenizer directory, or `estimate` for characters / token."
    )
    chars_per_token: PositiveFloat = Field(4.0, description="Used only with `tokenizer: estimate`.")
    max_model_len: PositiveInt
    tokenizer_backend: Literal["auto", "fastokens", "tokenizers"] = Field(
        "auto",
        description=(
            "The library that encodes this model's prompts; counts are exact either way (the"
            " chat rendered by its template, then one encode). `auto`: fastokens when a self-check"
            " at load shows it encodes every probe exactly as the tokenizers library does, else"
            " the tokenizers library. `fastokens`: refuse the policy when it does not."
            " `tokenizers`: the tokenizers library (what transformers, and so vLLM, use)."
        ),
    )
    default_output_tokens: PositiveInt = Field(
        512, description="Expected output when the request gives no bound and nothing is learned."
    )
    image_tokens: PositiveInt | None = Field(
        None,
        description=(
            "Tokens one image occupies in the prompt as the replica counts it, placeholder"
            " included; unset: the model takes no images and a request with image parts gets"
            " 400 `images_not_supported`. Gemma 3: 260, since its processor replaces each"
            " `<start_of_image>` the chat template writes with `\\n\\n` + `<start_of_image>` +"
            " 256 image tokens + `<end_of_image>` + `\\n\\n` (`\\n\\n` is one token), with"
            " pan-and-scan off (vLLM's default)."
        ),
    )
    max_images: PositiveInt = Field(
        16, description="Image parts one request may carry; more: 400 `too_many_images`."
    )


class QueueSpec(Spec):
    max_depth: int = Field(1024, ge=0, description="Waiting requests per pool; beyond it: 429.")
    max_wait_s: PositiveFloat = Field(30.0, description="Longest wait for a slot; then 429.")
    retry_after_s: PositiveFloat = Field(1.0, description="Retry-After sent with a queue refusal.")
    fail_fast: bool = Field(
        True,
        description=(
            "Refuse at once (429 `queue_wait_too_long`, the predicted wait as Retry-After) a request whose"
            " predicted wait, its place in the queue over the measured drain rate, is confidently"
            " above `max_wait_s`; nothing is refused early without enough drain history."
        ),
    )


class ForecastSpec(Spec):
    """How `llm_pool_desired_replicas_forecast` extrapolates (gateway/admit/forecast.py, which
    reads these immutable fields as they are)."""

    level_s: PositiveFloat = Field(
        60.0, description="Time constant of the demand's level: longer is steadier and later."
    )
    trend_s: PositiveFloat = Field(
        300.0, description="Time constant of its trend: how long a ramp lasts before it counts."
    )
    damping_s: PositiveFloat = Field(
        300.0, description="The extrapolated trend fades with this time constant over the horizon."
    )
    ceiling: float = Field(
        1.5,
        ge=1,
        description=(
            "The forecast is at most this multiple of the current demand: of its own level, and"
            " of the reactive estimate, so it falls with a burst that ended."
        ),
    )


class TimeoutSpec(Spec):
    """Each time-out maps to a clear error: 504 before the first byte, a terminal SSE error after."""

    connect_s: PositiveFloat = 5.0
    first_token_s: PositiveFloat = Field(
        120.0,
        description=(
            "Streams: longest wait from sending the request to the replica's first bytes of"
            " the stream. Any bytes count, an SSE comment (`: ping`) too: they prove it alive,"
            " and from then on `read_s` and `total_s` bound the stream."
        ),
    )
    read_s: PositiveFloat = Field(
        300.0, description="Longest silence from the replica (before headers or between chunks)."
    )
    total_s: PositiveFloat = Field(1800.0, description="Longest a request may take in all.")


class RetrySpec(Spec):
    """Envoy-style retry budget: retries in flight stay under a share of the requests in flight,
    with a floor so a lone failure is always retried, but retries cannot amplify an outage."""

    budget_percent: float = Field(20.0, ge=0, le=100)
    min_concurrent: int = Field(3, ge=0, description="Retries always allowed in flight at once.")


class HealthSpec(Spec):
    """Instance-level circuit breaking: active `/health` probes and passive outlier detection."""

    interval_s: float = Field(5.0, ge=0, description="Active check period; 0 turns probes off.")
    timeout_s: PositiveFloat = 2.0
    path: str = "/health"
    consecutive_failures: PositiveInt = Field(
        3, description="Failed requests or probes in a row that eject a replica."
    )
    ejection_s: PositiveFloat = Field(
        30.0, description="Base ejection time; it grows with each ejection of the same replica."
    )
    max_ejection_percent: float = Field(
        50.0, ge=0, le=100, description="Never eject more of a pool than this (at least one stays)."
    )
    slow_ratio: float = Field(
        0.8,
        gt=0,
        le=1,
        description=(
            "A replica whose decode speed (1 / TPOT) stays below this share of its peers' median"
            " for `slow_window_s` is ejected as `slow` (the article: 80% for 5 minutes)."
        ),
    )
    slow_window_s: PositiveFloat = 300.0
    reconcile_interval_s: float = Field(
        15.0,
        ge=0,
        description=(
            "How often the replica's own `vllm:num_requests_running + vllm:num_requests_waiting`"
            " is read from its /metrics and compared with this gateway's count; 0: never."
        ),
    )


class DnsSpec(Spec):
    """Replicas from a DNS name, e.g. a Kubernetes headless Service: every A / AAAA record is a
    replica, re-resolved every `interval_s`. (A ClusterIP Service would balance behind the
    gateway's back and defeat per-replica caps.)"""

    name: str = Field(description="`host:port`, e.g. gemma3-27b-gen.llm.svc.cluster.local:8000")
    scheme: Literal["http", "https"] = "http"
    interval_s: PositiveFloat = 10.0
    nameservers: list[str] = Field(
        [], description="`ip` or `ip:port` (one port for all); empty: the system's resolv.conf."
    )

    @field_validator("name")
    @classmethod
    def _host_port(cls, name: str) -> str:
        host, _, port = name.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{name!r} must be host:port")
        return name

    @field_validator("nameservers")
    @classmethod
    def _one_port(cls, servers: list[str]) -> list[str]:
        if len({s.rpartition(":")[2] if ":" in s else "53" for s in servers}) > 1:
            raise ValueError("all nameservers must use the same port")
        return servers


class ScorerSpec(Spec):
    """A scorer's weight and parameters: `prefix: 3`, or `prefix: {weight: 3, block_chars: 512}`."""

    weight: PositiveFloat = 1.0
    parameters: dict[str, Any] = {}

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return {"weight": value}
        if isinstance(value, dict) and "parameters" not in value:
            rest = {k: v for k, v in value.items() if k != "weight"}
            return {"weight": value.get("weight", 1.0), "parameters": rest}
        return value


class PickSpec(Spec):
    """How a pool chooses among replicas with room: weighted scorers (docs/architecture.md,
    "Picking a replica"). Without `pick`, the policy's `plugins.picker` (least in flight)."""

    # Any name here: the names are the registered scorers' (`gateway.pick`), which this bottom
    # layer does not import. `policy/compile.py` checks them and `llm-gateway schema` lists them.
    scorers: dict[str, ScorerSpec] = Field(
        min_length=1,
        description=(
            "Scorer -> weight (or `{weight, ...parameters}`), a scorer the gateway registers:"
            " e.g. `prefix` (prompt blocks this gateway sent each replica), `precise_prefix`"
            " (token blocks each replica's vLLM says it holds), `session` (the replica a session"
            " last used), `queue` (requests there), `kv_cache` (free KV cache); all of them in"
            " docs/architecture.md. Each rates the replicas 0..1; the highest weighted sum wins."
        ),
    )
    max_load_spread: float = Field(
        0.125,
        gt=0,
        le=1,
        description=(
            "Only replicas running at most this share of `max_concurrency` more requests than"
            " the least loaded one are scored: affinity never piles load on one replica."
        ),
    )
    metrics_interval_s: PositiveFloat = Field(
        1.0,
        description=(
            "With a scorer of the replicas' gauges (`queue`, `kv_cache`): how often each"
            " replica's /metrics is read for them (else `health.reconcile_interval_s`)."
        ),
    )

    def weighted(self) -> dict[str, tuple[float, dict[str, Any]]]:
        return {name: (s.weight, s.parameters) for name, s in self.scorers.items()}


class SloSpec(Spec):
    """Latency objectives for a request: time to its first token and per output token after it."""

    ttft_ms: PositiveFloat | None = Field(
        None, description="Time to first token, from the request's arrival at the gateway."
    )
    tpot_ms: PositiveFloat | None = Field(
        None, description="Time per output token after the first."
    )

    @model_validator(mode="after")
    def _not_empty(self) -> SloSpec:
        if self.ttft_ms is None and self.tpot_ms is None:
            raise ValueError("give ttft_ms, tpot_ms or both")
        return self


class LatencyModelSpec(Spec):
    """The latency model's seed (gateway/admit/latency.py): where its online fit starts, per
    replica. `llm-loadtest seed-latency` writes one from a simulated or measured sweep; one
    that failed may write an infinite coefficient, which would make every prediction infinite
    or NaN: refused."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    ttft_base_ms: float = Field(
        20.0, ge=0, description="TTFT of a short prompt on an idle replica."
    )
    ttft_per_1k_prefill_ms: float = Field(
        60.0,
        ge=0,
        description=(
            "TTFT per thousand prompt tokens to prefill before the first token: the request's own"
            " uncached ones and those of the requests granted there still prefilling."
        ),
    )
    ttft_per_running_ms: float = Field(
        1.0, ge=0, description="TTFT added per request decoding on the replica."
    )
    tpot_base_ms: float = Field(15.0, ge=0, description="TPOT of one sequence alone.")
    tpot_per_running_ms: float = Field(
        0.3, ge=0, description="TPOT added per sequence in the decode batch it joins."
    )
    tpot_per_1k_context_ms: float = Field(
        0.05, ge=0, description="TPOT added per thousand tokens of context in that batch."
    )
    forgetting: float = Field(
        0.995,
        gt=0.9,
        le=1.0,
        description=(
            "Weight the fit keeps of its past at each sample: lower follows a changing replica"
            " sooner and is noisier; 1 never forgets."
        ),
    )


class AdaptiveSpec(Spec):
    """Caps that find the knee: each replica's concurrency and in-flight token caps move between
    a floor and the pool's `max_concurrency` / `max_inflight_tokens` to hold a latency target."""

    target: SloSpec | None = Field(
        None,
        description=(
            "The latency each replica's cap holds its requests to (the observed quantile below);"
            " unset: the pool's `standard` objective."
        ),
    )
    max_concurrency: PositiveInt | None = Field(
        None,
        description=(
            "The ceiling of a replica's cap; unset: the pool's `max_concurrency`. Set above it,"
            " the pool's `max_concurrency` is where each replica's cap starts, and a cap written"
            " too low grows past it to the knee (the in-flight token cap in proportion)."
        ),
    )
    min_concurrency: PositiveInt = Field(
        1,
        description=(
            "The floor of a replica's cap: at most `max_concurrency`, and more than the slots"
            " `reserve` keeps."
        ),
    )
    quantile: float = Field(
        0.9, gt=0, lt=1, description="The quantile of observed TTFT / TPOT held to the target."
    )
    interval_s: PositiveFloat = Field(
        2.0, description="Shortest time between two moves of a replica's cap."
    )
    min_samples: PositiveInt = Field(
        8, description="Requests observed on a replica before its cap moves on them."
    )
    backoff: float = Field(
        0.85, gt=0, lt=1, description="A cap over its target is multiplied by this."
    )
    margin: float = Field(
        0.1,
        ge=0,
        lt=1,
        description=(
            "A cap grows only while the observed latency is under the target by this fraction,"
            " and only while the replica used it."
        ),
    )


class PreemptSpec(Spec):
    """A critical request predicted to miss its objective on every replica may cancel the newest
    sheddable request in flight on the best one; the cancelled request is refused retryably
    (`preempted`) and charged only what it was delivered."""

    enabled: bool = Field(False, description="Off by default: a cancelled answer is work lost.")
    max_per_s: PositiveFloat = Field(
        1.0, description="Per pool, at most this many requests are preempted a second."
    )
    burst: PositiveInt = Field(2, description="Preemptions allowed at once above the pace.")


class PoolSloSpec(Spec):
    """The pool admits by predicted latency: each replica's latency model, objectives per
    request, headroom placement and deadline order (docs/operations.md, "Latency objectives")."""

    objectives: dict[Tier, SloSpec] = Field(
        {},
        description=(
            "Default objectives per tier, for requests whose tenant, class and headers state none."
        ),
    )
    headers: bool = Field(
        True,
        description=(
            "Take a client's `x-slo-ttft-ms` / `x-slo-tpot-ms` (or llm-d's"
            " `x-llm-d-slo-ttft-ms` / `x-llm-d-slo-tpot-ms`) over the policy's objectives."
        ),
    )
    model: LatencyModelSpec = LatencyModelSpec()
    adaptive: AdaptiveSpec | None = Field(
        None, description="Caps that find the knee; unset: the caps stay as written."
    )
    preempt: PreemptSpec = PreemptSpec()

    @model_validator(mode="after")
    def _adaptive_has_a_target(self) -> PoolSloSpec:
        if self.adaptive is not None and self.adaptive.target is None:
            if "standard" not in self.objectives:
                raise ValueError(
                    "`adaptive` needs a `target`, or `objectives.standard` to take as one"
                )
        return self

    @property
    def adaptive_target(self) -> SloSpec | None:
        if self.adaptive is None:
            return None
        return self.adaptive.target or self.objectives["standard"]


class PoolSpec(Spec):
    model: str = Field(
        description=(
            "The model name the replicas serve; requests for an alias are rewritten to it (a"
            " request for one of `adapters` keeps its name)."
        )
    )
    replicas: list[str] = Field([], description="Static replica URLs; or give `dns`.")
    dns: DnsSpec | None = Field(None, description="Discover the replicas from DNS instead.")
    max_concurrency: PositiveInt = Field(description="Per replica: requests in flight.")
    max_inflight_tokens: PositiveInt | None = Field(
        None, description="Per replica: input + expected output tokens of the requests in flight."
    )
    max_output_tokens: PositiveInt | None = Field(
        None,
        description=(
            "Most output one request may ask for here: its `max_tokens` (or"
            " `max_completion_tokens`, `max_output_tokens`) times its completions (`n` x"
            " prompts); more: 400 `max_output_tokens_exceeded`, and a route's fallback with this"
            " limit is passed over by what it refuses. A request stating no bound is bounded by"
            " the context alone. Unset: no limit but the context."
        ),
    )
    startup_s: PositiveFloat = Field(
        600.0,
        description=(
            "Seconds from asking for a new replica to its serving: the horizon of"
            " `llm_pool_desired_replicas_forecast`. The default, 10 minutes, is a TPU v6e replica"
            " of Gemma 3 27B on vLLM with its XLA compilation cache kept: node provisioning,"
            " image pull and weight load take minutes, and compilation 1-3 minutes from the"
            " cache against 10-30 without it (vLLM's TPU figures; docs/operations.md). Measure"
            " yours, Pod created to Ready, and set it."
        ),
    )
    forecast: ForecastSpec = ForecastSpec()
    pick: PickSpec | None = Field(
        None, description="Weighted replica scorers; unset: the policy's `plugins.picker`."
    )
    queue: QueueSpec = QueueSpec()
    slo: PoolSloSpec | None = Field(
        None,
        description=(
            "Admit by predicted latency against per-request objectives; unset: no objective is"
            " applied or predicted here, and a client's SLO headers are ignored."
        ),
    )
    timeouts: TimeoutSpec = TimeoutSpec()
    retry: RetrySpec = RetrySpec()
    health: HealthSpec = HealthSpec()
    shed: dict[Literal["critical", "standard", "sheddable"], PositiveFloat] = Field(
        {},
        description=(
            "Service-level degradation: a request of a tier is refused (429 `shed`) while the"
            " pool's saturation, (in flight + waiting) / capacity, is at or above the tier's"
            " threshold. Lower tiers must shed first: sheddable <= standard <= critical. A tier"
            " without a threshold is never shed (by default none is)."
        ),
    )
    reserve: dict[str, PositiveInt] = Field(
        {},
        description=(
            "Per replica, slots kept for a class (e.g. `classification: 16` of 64) that other"
            " classes may not take while it does not use them; every class may borrow the"
            " unreserved idle slots. The reservations must leave at least one slot unreserved."
        ),
    )
    tls_ca_file: str | None = Field(
        None,
        description=(
            "CA bundle (PEM) `https://` replicas' certificates are verified against, relative to"
            " the policy file; unset: the system's trust store. Read when the pool's connections"
            " are first made: a changed bundle takes effect at the next start."
        ),
    )
    api_key_env: str | None = Field(
        None, description="Environment variable holding the replicas' API key (sent as Bearer)."
    )
    forward_client_authorization: bool = Field(
        True,
        description=(
            "On a gateway without tenants, pass the client's `Authorization` header to this"
            " pool's replicas (replicas that check keys themselves rely on it). With tenants the"
            " client's key is never forwarded, and `api_key_env` replaces it in any case."
        ),
    )
    adapters: list[AdapterName] = Field(
        [],
        description=(
            "LoRA adapters the replicas serve on top of `model` (vLLM's `--lora-modules`): a"
            " request naming one goes to this pool and keeps the adapter's name upstream. More"
            " are discovered from each replica's `/v1/models` (cards with a `parent`) every"
            " `health.reconcile_interval_s`."
        ),
    )
    upstream_priority: bool | dict[Literal["critical", "standard", "sheddable"], VllmInt] = Field(
        False,
        description=(
            "Send the request's tier upstream in vLLM's `priority` field, for replicas started"
            " with `--scheduling-policy priority` (lower runs first): `true` sends 0 for"
            " critical, 1 standard, 2 sheddable; a mapping gives every tier its own integer."
            " A client's own `priority` never reaches a replica either way."
        ),
    )

    @field_validator("dns", mode="before")
    @classmethod
    def _dns_shorthand(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @field_validator("adapters")
    @classmethod
    def _distinct_adapters(cls, adapters: list[str]) -> list[str]:
        if len(set(adapters)) != len(adapters):
            raise ValueError("adapters must be distinct")
        return adapters

    @field_validator("upstream_priority")
    @classmethod
    def _tiers_in_order(cls, given: bool | dict[str, int]) -> bool | dict[str, int]:
        if isinstance(given, dict):
            if set(given) != set(PRIORITIES):
                raise ValueError(f"give an integer for each tier: {', '.join(PRIORITIES)}")
            values = [given[t] for t in PRIORITIES]
            if values != sorted(values):  # vLLM runs the lowest first
                raise ValueError(
                    "a higher tier needs a lower or equal number (vLLM runs lower first)"
                )
        return given

    @field_validator("shed")
    @classmethod
    def _lowest_first(cls, shed: dict[str, float]) -> dict[str, float]:
        given = [shed[t] for t in reversed(PRIORITIES) if t in shed]  # sheddable first
        if given != sorted(given):
            raise ValueError("a lower tier must shed at a lower or equal saturation")
        return shed

    @model_validator(mode="after")
    def _one_source(self) -> PoolSpec:
        if bool(self.replicas) == (self.dns is not None):
            raise ValueError("give either `replicas` (a non-empty list) or `dns`")
        return self

    @model_validator(mode="after")
    def _reserve_fits(self) -> PoolSpec:
        if sum(self.reserve.values()) >= self.max_concurrency:
            raise ValueError(
                f"`reserve` keeps {sum(self.reserve.values())} slots of {self.max_concurrency}:"
                " leave at least one for the other classes"
            )
        return self

    @model_validator(mode="after")
    def _adaptive_floor_fits(self) -> PoolSpec:
        adaptive = self.slo.adaptive if self.slo is not None else None
        if adaptive is None:
            return self
        floor = adaptive.min_concurrency
        if adaptive.max_concurrency is not None and adaptive.max_concurrency < self.max_concurrency:
            raise ValueError(
                f"`slo.adaptive.max_concurrency` ({adaptive.max_concurrency}) is under"
                f" `max_concurrency` ({self.max_concurrency}), where the caps start: give the"
                " pool's the lower one"
            )
        if floor > self.max_concurrency:
            raise ValueError(
                f"`slo.adaptive.min_concurrency` ({floor}) is over `max_concurrency`"
                f" ({self.max_concurrency}): the floor of the adaptive caps is under their top"
            )
        if floor <= sum(self.reserve.values()):
            raise ValueError(
                f"`slo.adaptive.min_concurrency` ({floor}) leaves no slot beside the"
                f" {sum(self.reserve.values())} `reserve` keeps: a cap at its floor would take"
                " no request of the other classes"
            )
        return self

    @field_validator("replicas")
    @classmethod
    def _urls(cls, replicas: list[str]) -> list[str]:
        for url in replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} must be an http:// or https:// URL")
            parts = urlsplit(url)
            if "@" in parts.netloc:  # and never echo the credentials it carries
                raise ValueError(
                    "a replica URL carries no credentials: give the key in `api_key_env`"
                )
            if not parts.hostname:  # else the forward stage finds out, request by request
                raise ValueError(f"{url!r} names no host")
        if len(set(replicas)) != len(replicas):
            raise ValueError("replicas must be distinct")
        return [url.rstrip("/") for url in replicas]


StrOrList = str | list[str]


class When(Spec):
    """Conditions of a class; all given ones must hold. An empty `when` matches everything."""

    input_tokens: Range | None = None
    output_tokens: Range | None = Field(None, description="Expected output tokens.")
    output_input_ratio: Range | None = Field(None, description="Expected output / input tokens.")
    model: StrOrList | None = Field(None, description="Requested model name(s); `*` globs allowed.")
    endpoint: Endpoint | list[Endpoint] | None = Field(
        None,
        description="Endpoint name(s): `chat`, `messages`, ... (docs/api.md, Endpoints and headers).",
    )
    header: dict[str, str] | None = Field(
        None, description="Header name -> value (`*` globs allowed); all must match."
    )


class ClassSpec(Spec):
    name: str = Field(pattern=r"^[a-z][a-z0-9_-]*$")
    when: When = When()
    slo: SloSpec | None = Field(
        None, description="Objectives for the class's requests, on pools with `slo`."
    )


class RouteMatch(Spec):
    model: StrOrList | None = Field(None, description="Requested model name(s); `*` globs allowed.")
    class_: StrOrList | None = Field(None, alias="class")
    endpoint: Endpoint | list[Endpoint] | None = Field(
        None,
        description="Endpoint name(s): `chat`, `messages`, ... (docs/api.md, Endpoints and headers).",
    )
    header: dict[str, str] | None = None


class SpillWhen(Spec):
    """When the route's own pool counts as full for a new request; any condition given holds."""

    saturation_gte: PositiveFloat | None = Field(
        1.0,
        description=(
            "The primary's saturation ((in flight + waiting) / capacity, every gateway's with a"
            " ledger) at or over this: 1.0 is every slot busy."
        ),
    )
    predicted_wait_gte_s: PositiveFloat | None = Field(
        None,
        description=(
            "The request's predicted wait for a slot on the primary (its place in line over the"
            " measured drain rate, as fail-fast predicts it) at or over this many seconds."
        ),
    )

    @model_validator(mode="after")
    def _some_condition(self) -> SpillWhen:
        if self.saturation_gte is None and self.predicted_wait_gte_s is None:
            raise ValueError("give saturation_gte, predicted_wait_gte_s or both")
        return self


class FallbackSpec(Spec):
    """A pool a request may spill to when its route's pool is full and this one has room."""

    pool: str
    when: SpillWhen = SpillWhen()
    below_saturation: PositiveFloat = Field(
        1.0,
        description=(
            "The fallback has room while its own saturation is under this: 1.0 is a free slot"
            " with nobody waiting for it, so a spilled request never queues behind the"
            " fallback's own traffic."
        ),
    )
    tiers: list[Literal["critical", "standard", "sheddable"]] = Field(
        ["critical", "standard"],
        min_length=1,
        description=(
            "Tiers that may spill. Sheddable traffic is left out by default: it is the first to"
            " be shed, not the first to take a warm pool's room."
        ),
    )


class RouteSpec(Spec):
    match: RouteMatch = RouteMatch()
    pool: str
    fallback: list[FallbackSpec] = Field(
        [],
        description=(
            "Pools to spill to, tried in order, when `pool` is full (docs/operations.md,"
            " Spill-over)."
        ),
    )
    allow_model_substitution: bool = Field(
        False,
        description=(
            "Let a fallback serve another model than the route's pool (27B -> 12B); the client"
            " sees it in `x-gateway-model`. Off: every fallback serves the same model."
        ),
    )
    passthrough: list[Annotated[str, Field(pattern=r"^/[A-Za-z0-9._~/-]+$")]] = Field(
        [],
        description=(
            "More paths this route's pool serves (a deployment's own `/asr/v1/audio/speech`, say): a `POST`"
            " there is authenticated, charged one request, admitted by request count and"
            " forwarded as it came, its body unread (multipart included), not counted."
        ),
    )


class PluginSpec(Spec):
    type: str
    parameters: dict[str, Any] = {}


class PluginsSpec(Spec):
    picker: PluginSpec = PluginSpec(type="least-inflight")
    output_estimator: PluginSpec = PluginSpec(type="rolling-quantile")


class ListenerTlsSpec(Spec):
    """HTTPS on the listener: the certificate (PEM, the chain after it) and its private key."""

    cert_file: str = Field(
        description=(
            "The certificate chain (PEM), relative to the policy file; reloaded when it changes"
            " (a renewed Secret), without a restart."
        )
    )
    key_file: str = Field(
        description="Its private key (PEM, unencrypted), relative to the policy file."
    )


class ServerSpec(Spec):
    """The listener: request limits, client time-outs, drain, and tokenization resources.

    Every limit is checked before any tokenizer work, and every refusal is in the OpenAI error
    shape (docs/api.md, Errors).
    """

    tls: ListenerTlsSpec | None = Field(
        None,
        description=(
            "HTTPS on the listener (the API port; the metrics port stays HTTP); unset: HTTP."
            " Turning it on or off takes a restart; a renewed certificate does not."
        ),
    )
    max_body_bytes: PositiveInt = Field(
        8 * 1024 * 1024, description="Largest request body; beyond it: 413 `request_too_large`."
    )
    max_headers: PositiveInt = Field(
        64,
        description=(
            "Request header fields; beyond it: 431 `headers_too_large`. aiohttp's parser stops"
            " reading at twice this (also a 431), so headers never pile up unbounded."
        ),
    )
    max_header_bytes: PositiveInt = Field(
        16 * 1024,
        description=(
            "Names and values of all request header fields together; beyond it: 431"
            " `headers_too_large`. No single line (the request line or one field) may be longer:"
            " aiohttp's parser stops reading it (also a 431)."
        ),
    )
    max_json_nodes: PositiveInt = Field(
        65_536,
        description=(
            "JSON values in the body, counted on its structural characters (`[`, `{`, `,`, `:`"
            " outside strings) before it is parsed; beyond it: 400 `json_too_complex`. Parsing"
            " costs per value and holds the event loop (docs/benchmarks.md). A"
            " completions prompt of token ids counts one per id: raise it for longer ones."
        ),
    )
    max_json_depth: int = Field(
        64,
        ge=1,
        le=1024,
        description=(
            "Nesting of objects and arrays in the body (`{}` is 1); beyond it: 400"
            " `json_too_deep`. orjson refuses more than 1024 levels itself."
        ),
    )
    max_messages: PositiveInt = Field(
        2048, description="Messages in a chat request; beyond it: 400 `too_many_messages`."
    )
    max_stored_responses: PositiveInt = Field(
        100_000,
        description=(
            "Stored responses (Responses API) whose replica and conversation the gateway"
            " remembers, to send `previous_response_id`, `GET /v1/responses/{id}` and its"
            " cancel there and count a continuing turn exactly; the least recently used are"
            " forgotten first (each about 200 bytes plus its own turn's input and output text:"
            " earlier turns are shared)."
        ),
    )
    max_content_parts: PositiveInt = Field(
        2048,
        description=(
            "Content parts of a chat request's messages together; beyond it: 400"
            " `too_many_parts`. Each part is checked on the event loop before counting."
        ),
    )
    max_n: PositiveInt = Field(
        16,
        description=(
            "Completions one request may ask for (`n`); beyond it: 400 `too_many_choices`. A"
            " request holds its prompt plus `n` outputs against a replica's"
            " `max_inflight_tokens`, and one that needs a replica to itself waits for it to drain."
        ),
    )
    max_prompt_chars: PositiveInt = Field(
        1_000_000,
        description=(
            "Characters of prompt text (message contents, or all prompts of a completion),"
            " checked before tokenizing; beyond it: 400 `prompt_too_long`. Keep it above the"
            " largest `max_model_len` times the characters per token the models see."
        ),
    )
    max_response_bytes: PositiveInt = Field(
        64 * 1024 * 1024,
        description=(
            "Largest non-streamed answer from a replica, which the gateway holds whole to"
            " relay it; beyond it: 502 `response_too_large`, and the replica's connection is"
            " closed. Streams are relayed as they come and never held whole."
        ),
    )
    response_model: Literal["upstream", "requested"] = Field(
        "upstream",
        description=(
            "The `model` field of answers: `upstream`, what the replica reports (the pool's model"
            " for an alias); `requested`, the name the client sent, as LiteLLM answers: rewritten"
            " in a JSON answer and in each event of a stream as it passes, never buffered. Set"
            " for the whole gateway, not per route: an alias spans routes chosen by class, and"
            " the name a client sees must not depend on its request's size."
        ),
    )
    idle_timeout_s: PositiveFloat = Field(
        75.0,
        description=(
            "Longest a connection may go without a complete request head, counted from when it"
            " opened or answered its last request: idle keep-alive connections and clients that"
            " dribble their headers (slow loris) are closed. Keep it above the idle time-out of"
            " any proxy in front of the gateway."
        ),
    )
    body_timeout_s: PositiveFloat = Field(
        30.0,
        description=(
            "Longest a client may take to send its body once the headers are in; then 408"
            " `request_timeout` and the connection is closed."
        ),
    )
    drain_grace_s: float = Field(
        30.0, ge=0, description="How long SIGTERM waits for in-flight work."
    )
    readiness_delay_s: float = Field(
        0.0, ge=0, description="After SIGTERM, /readyz fails this long before the listener closes."
    )
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "Serve `/metrics` on this port only (same host as the listener) and answer 404 for it"
            " on the public port: its labels name tenants and replica URLs. Unset: `/metrics` is"
            " on the public port while the policy has no tenants, and with tenants nowhere (a"
            " 404). Read at start; a reload does not move it."
        ),
    )
    access_log: bool = True
    tokenizer_threads: PositiveInt | None = Field(
        None,
        description=(
            "Threads in each of the two tokenizer pools (texts over `inline_tokenize_max_chars`,"
            " and those of `large_tokenize_chars` or more). Unset: the CPUs the container may use,"
            " the smaller of its CPU affinity and its cgroup CPU quota rounded up (at least 1),"
            " so a pod limited to 2 CPUs on a large node does not start a thread per node core;"
            " with `serve --workers N`, each worker's share of them. Read at start; a reload does"
            " not change it."
        ),
    )
    inline_tokenize_max_chars: int = Field(
        24576,
        ge=0,
        description=(
            "Text longer than this is tokenized on the tokenizer threads, off the event loop;"
            " shorter text is counted inline, which saves the threads' hand-off. The default keeps"
            " an inline count of fastokens within a few milliseconds whatever the text"
            " (docs/benchmarks.md); a model counted by the tokenizers library inlines an eighth"
            " of this (it spends several times the CPU per character)."
        ),
    )
    large_tokenize_chars: PositiveInt = Field(
        65_536,
        description=(
            "Text of this many characters or more is tokenized on `tokenizer_threads` threads of"
            " its own, so a few huge prompts never make the small ones queue behind them."
        ),
    )


class AdminSpec(Spec):
    """Changing the running policy: the file is watched, SIGHUP and `POST /admin/reload` reload it."""

    token_env: str = Field(
        "LLM_GATEWAY_ADMIN_TOKEN",
        description="Environment variable holding the admin bearer token; unset: admin endpoints off.",
    )
    watch_interval_s: float = Field(
        2.0, ge=0, description="How often the policy file is checked for changes; 0: not watched."
    )


class TracingSpec(Spec):
    """OpenTelemetry traces: a server span per request, its stages' spans, and the context
    forwarded to the replica so vLLM's own spans (`--otlp-traces-endpoint`) join the trace."""

    endpoint: str = Field(
        description=(
            "The OTLP/HTTP traces endpoint spans are exported to (a collector's"
            " `http://HOST:4318/v1/traces`)."
        ),
    )
    sample_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description=(
            "The share of new traces sampled; a request whose `traceparent` carries a sampling"
            " decision keeps it (parent-based)."
        ),
    )
    service_name: str = Field("llm-admission-gateway", description="The spans' `service.name`.")
    timeout_s: float = Field(10.0, gt=0, description="Per export to the endpoint.")

    @field_validator("endpoint")
    @classmethod
    def _http(cls, value: str) -> str:
        if urlsplit(value).scheme not in ("http", "https"):
            raise ValueError("must be an http:// or https:// URL")
        return value


KeyHash = Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]


class WindowLimits(Spec):
    """A tenant's limits on one model or pool, on top of its overall ones."""

    tpm: PositiveInt | None = Field(None, description="Tokens per sliding minute.")
    rpm: PositiveInt | None = Field(None, description="Requests per sliding minute.")


class TenantSpec(Spec):
    """A team or client: who it is (its API keys), how it is queued, and what it may spend.

    Keys are never written in the policy in the clear: `keys` holds SHA-256 hashes, and raw keys
    can come from a mounted Secret (`keys_file`) or the environment (`keys_env`).
    """

    keys: list[KeyHash] = Field(
        [], description="`sha256:<hex>` of each API key (`printf %s KEY | sha256sum`)."
    )
    keys_file: str | None = Field(
        None,
        description=(
            "File with one key or `sha256:<hex>` per line (a Kubernetes Secret mount);"
            " relative to the policy file; read when the policy is loaded."
        ),
    )
    keys_env: str | None = Field(
        None, description="Environment variable holding keys or hashes, separated by whitespace."
    )
    tier: Tier = Field(
        "standard", description="Queue priority; `x-priority` may lower it, never raise it."
    )
    slo: SloSpec | None = Field(
        None,
        description=(
            "The tenant's objectives, on pools with `slo`: over its class's and its tier's."
        ),
    )
    tpm: PositiveInt | None = Field(
        None,
        description=(
            "Tokens per minute (input + output) over a sliding 60-second window; none: unlimited."
        ),
    )
    rpm: PositiveInt | None = Field(
        None, description="Requests per minute over a sliding 60-second window; none: unlimited."
    )
    max_output_tokens: PositiveInt | None = Field(
        None,
        description=(
            "With a TPM window (the tenant's, a model's or a pool's): the output bound a request"
            " that states none is given, reserved against the window and written into what the"
            " replica is sent (`max_tokens`, `max_output_tokens`), so the replica cannot generate"
            " more than was reserved: such an answer ends with finish reason `length` there."
            " Cut to what the context and the window leave. None: the model's"
            " `default_output_tokens`."
        ),
    )
    burst_tokens: int = Field(
        512,
        ge=0,
        description=(
            "How far a request's charge may exceed what was reserved for it on the replica's"
            " word: its usage is charged up to the reservation plus this (a prompt the replica"
            " counts higher than the gateway: images its processor expands, a `tokenizer:"
            " estimate` model), so a replica's claim adds at most this to a window. About one"
            " answer's worth by default."
        ),
    )
    models: dict[str, WindowLimits] = Field(
        {}, description="Limits per served model (a name under `models`), on top of tpm / rpm."
    )
    pools: dict[str, WindowLimits] = Field(
        {}, description="Limits per pool, on top of tpm / rpm and any model's."
    )
    weight: PositiveFloat = Field(
        1.0,
        description=(
            "Its share of the tokens its tier is served while the queue is contended: a tenant"
            " of weight 2 gets twice the tokens of a tenant of weight 1 of the same tier."
        ),
    )

    @model_validator(mode="after")
    def _has_keys(self) -> TenantSpec:
        if not self.keys and self.keys_file is None and self.keys_env is None:
            raise ValueError("give at least one of keys, keys_file, keys_env")
        return self


class SlicesSpec(Spec):
    """Shares of each quota window a gateway leases from Redis, so most requests charge theirs
    without a Redis call (gateway/state/slices.py): fewer calls, for a little room held back."""

    fraction: float = Field(
        0.05,
        ge=0,
        lt=1,
        description=(
            "Room a gateway leases beyond a request's own charge, as a fraction of the window's"
            " limit (up to what fits); held back from the other gateways for at most"
            " `max_age_s`. 0: every request charges Redis itself, exactly, with no slices."
        ),
    )
    max_age_s: PositiveFloat = Field(
        0.5,
        le=10,
        description=(
            "How long a slice serves requests before its unused part goes back; its charge"
            " counts in Redis this much longer than a request's, so no window over-grants."
        ),
    )


class StateSpec(Spec):
    """Where quota windows and replica slots live: this process (one gateway), or Redis shared
    by several, so the caps and limits hold across all of them.

    Read when the gateway starts; a reload that changes it takes effect at the next restart,
    since windows must outlive reloads.
    """

    backend: Literal["memory", "redis"] = Field(
        "memory", description="`memory`: one gateway's own windows; `redis`: shared by all."
    )
    url: str = Field("redis://127.0.0.1:6379/0", description="The Redis to share (`redis`).")
    on_failure: Literal["open", "closed"] = Field(
        "open",
        description=(
            "When Redis fails or times out: `open` counts locally at 1/`gateways` of each limit;"
            " `closed` answers 503 `state_unavailable`. Redis is retried every second."
        ),
    )
    gateways: PositiveInt = Field(
        1, description="Gateway replicas sharing the limits: the local share when failing open."
    )
    timeout_s: PositiveFloat = Field(
        0.5, description="Longest any Redis call (connect included) may take before it fails."
    )
    lease_ttl_s: PositiveFloat = Field(
        10.0,
        description=(
            "Life of a replica-slot lease in Redis unless its gateway renews it (every third of"
            " it): the slots of a gateway that dies return to the others this long after."
        ),
    )
    spare_slots_s: float = Field(
        0.1,
        ge=0,
        description=(
            "How long a replica-slot lease freed here may stay idle as this gateway's spare"
            " (still a lease in Redis) before it is given back: the next request of its class"
            " on that replica takes it without a Redis call. Kept only while no other gateway"
            " has requests waiting and Redis answers; 0: every lease goes back as it frees."
        ),
    )
    stored_response_ttl_s: PositiveFloat = Field(
        86400.0,
        description=(
            "How long Redis remembers which replica stores a response (Responses API) and its"
            " conversation so far (at most a context's worth of text), so any gateway sends its"
            " next turn, `GET` and cancel there and counts that turn exactly; from the last"
            " turn that wrote or read it."
        ),
    )
    slices: SlicesSpec = Field(
        SlicesSpec(), description="Quota windows leased in slices (`redis`): see `SlicesSpec`."
    )


class PolicySpec(Spec):
    models: dict[str, ModelSpec] = Field(min_length=1)
    pools: dict[str, PoolSpec] = Field(min_length=1)
    classes: list[ClassSpec] = Field(min_length=1, description="First match wins.")
    routes: list[RouteSpec] = Field(min_length=1, description="First match wins.")
    plugins: PluginsSpec = PluginsSpec()
    server: ServerSpec = ServerSpec()
    admin: AdminSpec = AdminSpec()
    state: StateSpec = StateSpec()
    tracing: TracingSpec | None = Field(
        None, description="OpenTelemetry traces; none: no spans, and no cost."
    )
    tenants: dict[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")], TenantSpec] = Field(
        {},
        description=(
            "Who may call, by API key (`Authorization: Bearer`); none: the gateway is open."
        ),
    )
