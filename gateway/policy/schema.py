"""The policy file's shape: pydantic models, frozen, unknown keys forbidden.

These models only describe and validate what the operator wrote. `compile.py` turns a validated
`PolicySpec` into the runtime `Policy` (tokenizers loaded, predicates built, plug-ins made) once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Endpoint = Literal["chat", "completions"]
PRIORITIES: tuple[str, ...] = ("critical", "standard", "sheddable")
"""Queue priorities, highest first; `x-priority` picks one (issue 6 ties them to tenant tiers)."""


class Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0)]


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


class ModelSpec(Spec):
    tokenizer: str = Field(
        description="Local Hugging Face tokenizer directory, or `estimate` for characters / token."
    )
    chars_per_token: PositiveFloat = Field(4.0, description="Used only with `tokenizer: estimate`.")
    max_model_len: PositiveInt
    token_counting: Literal["exact", "memoized"] = Field(
        "memoized",
        description=(
            "`exact` tokenizes the whole rendered chat prompt; `memoized` sums cached per-message"
            " counts plus the template's overhead (see docs/architecture.md for its error bound)."
        ),
    )
    default_output_tokens: PositiveInt = Field(
        512, description="Expected output when the request gives no bound and nothing is learned."
    )


class QueueSpec(Spec):
    max_depth: int = Field(1024, ge=0, description="Waiting requests per pool; beyond it: 429.")
    max_wait_s: PositiveFloat = Field(30.0, description="Longest wait for a slot; then 429.")
    retry_after_s: PositiveFloat = Field(1.0, description="Retry-After sent with a queue refusal.")


class TimeoutSpec(Spec):
    connect_s: PositiveFloat = 5.0
    read_s: PositiveFloat = Field(
        300.0, description="Longest silence from the replica (before headers or between chunks)."
    )


class PoolSpec(Spec):
    model: str = Field(
        description="The model name the replicas serve; requests are rewritten to it."
    )
    replicas: list[str] = Field(min_length=1)
    max_concurrency: PositiveInt = Field(description="Per replica: requests in flight.")
    max_inflight_tokens: PositiveInt | None = Field(
        None, description="Per replica: input + expected output tokens of the requests in flight."
    )
    queue: QueueSpec = QueueSpec()
    timeouts: TimeoutSpec = TimeoutSpec()
    api_key_env: str | None = Field(
        None, description="Environment variable holding the replicas' API key (sent as Bearer)."
    )

    @field_validator("replicas")
    @classmethod
    def _urls(cls, replicas: list[str]) -> list[str]:
        for url in replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} must be an http:// or https:// URL")
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
    endpoint: Endpoint | list[Endpoint] | None = None
    header: dict[str, str] | None = Field(
        None, description="Header name -> value (`*` globs allowed); all must match."
    )


class ClassSpec(Spec):
    name: str = Field(pattern=r"^[a-z][a-z0-9_-]*$")
    when: When = When()


class RouteMatch(Spec):
    model: StrOrList | None = Field(None, description="Requested model name(s); `*` globs allowed.")
    class_: StrOrList | None = Field(None, alias="class")
    endpoint: Endpoint | list[Endpoint] | None = None
    header: dict[str, str] | None = None


class RouteSpec(Spec):
    match: RouteMatch = RouteMatch()
    pool: str


class PluginSpec(Spec):
    type: str
    parameters: dict[str, Any] = {}


class PluginsSpec(Spec):
    picker: PluginSpec = PluginSpec(type="least-inflight")
    output_estimator: PluginSpec = PluginSpec(type="rolling-quantile")


class ServerSpec(Spec):
    max_body_bytes: PositiveInt = 8 * 1024 * 1024
    drain_grace_s: float = Field(
        30.0, ge=0, description="How long SIGTERM waits for in-flight work."
    )
    readiness_delay_s: float = Field(
        0.0, ge=0, description="After SIGTERM, /readyz fails this long before the listener closes."
    )
    access_log: bool = True
    tokenizer_threads: PositiveInt = 2
    inline_tokenize_max_chars: int = Field(
        2048, ge=0, description="Text longer than this is tokenized off the event loop."
    )
    token_cache_entries: int = Field(8192, ge=0, description="Memoized message counts kept (LRU).")


class PolicySpec(Spec):
    models: dict[str, ModelSpec] = Field(min_length=1)
    pools: dict[str, PoolSpec] = Field(min_length=1)
    classes: list[ClassSpec] = Field(min_length=1, description="First match wins.")
    routes: list[RouteSpec] = Field(min_length=1, description="First match wins.")
    plugins: PluginsSpec = PluginsSpec()
    server: ServerSpec = ServerSpec()
