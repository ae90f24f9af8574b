"""The per-request context that flows through the pipeline's stages.

Each stage reads what earlier stages filled in and adds its own part; `account` reads all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from multidict import CIMultiDict, CIMultiDictProxy

if TYPE_CHECKING:
    from gateway.context.affinity import Affinity
    from gateway.context.compiled import Model, Pool, Route, Tenant
    from gateway.context.endpoint import Api
    from gateway.context.objective import Objective, Prediction
    from gateway.errors import Refusal
    from gateway.state import Holder
    from gateway.upstream import Cancel


class Trace(Protocol):
    """What the stages tell a traced request's spans (gateway/observability/tracing.py's
    `RequestTrace`): named here so the record carries it without importing the exporter."""

    @property
    def trace_id(self) -> str: ...

    def sending(self, replica: str, headers: CIMultiDict[str]) -> None: ...

    def answered(self, status: int | None) -> None: ...

    def finish(self, ctx: Ctx) -> None: ...


class Prefill(Protocol):
    """A request's prefill on its replica as the pool's latency model tracks it
    (gateway/admit/latency.py's `Flight`): told when its first token arrives."""

    def prefilled(self, at: float) -> None: ...


CLIENT_CLOSED = 499  # nginx's code for "the client went away"; bounded, so fine as a label


@dataclass(slots=True)
class Ctx:
    request_id: str
    api: Api  # the endpoint's (gateway/api/): where each stage's endpoint-specific part is
    path: str
    headers: CIMultiDictProxy[str]
    arrived: float  # time.perf_counter() when the request came in
    upstream_id: str = ""  # the replica's `x-request-id`: the gateway's own, never a client's
    # authenticate
    tenant: Tenant | None = None  # None: the policy has no tenants
    tier: int = 0  # the highest priority this request may have (0, critical, without tenants)
    raw: bytes = b""
    body: dict[str, Any] = field(default_factory=dict)
    requested_model: str = ""
    stream: bool = False
    client_wants_usage: bool = False
    # and the usage on every chunk too (`stream_options.continuous_usage_stats`, with the above)
    client_wants_continuous: bool = False
    priority: int = 1  # the tier, or lower if `x-priority` asks
    sequences: int = 1  # completions generated: n x prompts
    max_output: int | None = None  # the client's max_tokens / max_completion_tokens
    # `max_output` is the gateway's, not the client's: written into the replica's body so it
    # cannot generate more than the tenant's TPM window reserved (gateway/request/quota.py).
    bounded_by_gateway: bool = False
    # The request holds tokens of its tenant's TPM windows, settled when it ends: only then is a
    # stream's running count worth asking the replica for (`Api.asks_continuous`).
    tokens_charged: bool = False
    min_output: int = 0  # the client's min_tokens: generated whatever the model would stop at
    forced_output: bool = False  # ignore_eos: generated to max_output (or the context's end)
    images: int = 0  # image parts in a chat's messages, counted by tokenize at the model's rate
    continues: str | None = None  # a stored response the request continues (Responses API)
    stores_as: str | None = None  # the id the replica stores this request's response under
    # what the replica holding `continues` holds of it (gateway/request/holders.py)
    holder: Holder | None = None
    # tokenize
    input_tokens: int = 0
    longest_prompt: int = 0  # several prompts in one completions request are checked one by one
    # estimate
    fingerprint: int = 0
    expected_output: int = 0  # per completion choice
    estimate_source: str = ""
    # classify / route
    candidates: tuple[Route, ...] = ()
    adapter: str = ""  # the LoRA adapter asked for, kept upstream; "": the base model or an alias
    model: Model | None = None
    workload: str = ""
    route: Route | None = None
    pool: Pool | None = None
    spilled_from: str = ""  # the route's own pool, when the request spilled to a fallback
    # objective: its latency objective, on a pool with `slo` (gateway/request/objective.py)
    objective: Objective | None = None
    predicted: Prediction | None = None  # on the replica that took it, when it was granted
    prefill: Prefill | None = None  # its place in that replica's prefill work, with `slo`
    # admit / forward
    affinity: Affinity | None = (
        None  # what the pool's scorers weigh, worked out on its first attempt
    )
    replica: str = ""
    # How the gateway ends its exchange from outside its task, while it holds a slot on a pool
    # that preempts (gateway/admit/preempt.py); None elsewhere.
    cancel: Cancel | None = None
    queue_wait: float | None = None  # seconds waiting for a slot; None: refused before queueing
    retries: int = 0  # attempts on other replicas after one refused the request
    first_token: float | None = None
    output_tokens: int | None = None
    prompt_tokens: int | None = None  # the replica's own count, when its usage reports one
    # Of those, what its prefix cache served (vLLM's `prompt_tokens_details.cached_tokens`,
    # with `--enable-prompt-tokens-details`): None when the usage does not say.
    cached_tokens: int | None = None
    untrusted_usage: str = ""  # the usage field a replica reported out of bounds, if any
    # The output (and prompt) counts came from the replica's usage, every field in bounds: what
    # the quota settles on; otherwise it settles on the reservation (gateway/request/quota.py).
    usage_believed: bool = False
    # The output is the gateway's own count of the answer's text (`Api.count_answer`: a whole
    # transcription, whose usage is no count): what the tenant got, no replica's word to bound.
    output_counted: bool = False
    # A stored response's `output` items, from its stream's terminal event (gateway/request/holders.py)
    output: Any = None
    # A whole answer and where its `"usage"` is: decoded by the accounting, after the client
    # has the answer (`api/usage.py's read_usage`), so its few µs are not on the client's path.
    unread_usage: tuple[bytearray, int] | None = None
    chunks: int = 0
    # The output of the chunks written so far, by the replica's running usage
    # (gateway/api/openai.py `delivered`): None when it gave none or was not believed.
    delivered: int | None = None
    delivered_at: int = 0  # `chunks` as that count was read: a later chunk had none
    # The whole answer went to the client's connection (a stream's `[DONE]`, or its end): a
    # client that leaves after that was served (`forward.client_left`).
    answered: bool = False
    ratelimit_headers: dict[str, str] = field(default_factory=dict)  # the tenant's windows
    # The times stages record for the trace's spans (perf_counter): counting, from its start to
    # the route; the slot's grant (the queue's span ends there).
    counted: tuple[float, float] | None = None
    granted: float = 0.0
    trace: Trace | None = None  # the request's spans, when the policy traces
    # outcome
    status: int = 0
    refusal: Refusal | None = None  # what refused it (gateway/errors.py), or client_disconnect
    code: str = ""  # the `error.code` the client got: what the access log reports, to match
    ended: float = 0.0

    @property
    def endpoint(self) -> str:
        """The endpoint's name, as policies, metrics labels and the access log say it."""
        return self.api.name

    @property
    def served_model(self) -> str:
        return self.pool.spec.model if self.pool is not None else ""

    @property
    def upstream_model(self) -> str:
        """The `model` the replica gets: an adapter keeps its name, an alias becomes the pool's."""
        return self.adapter or self.served_model

    @property
    def admitted(self) -> bool:
        """A replica took the request: it was forwarded, whatever then became of its answer."""
        return bool(self.replica)

    @property
    def queued(self) -> bool:
        """The request reached a pool's admission (at once, or after a wait in its queue): it
        has a pool, a class and a queue wait to observe, admitted or not."""
        return self.queue_wait is not None

    @property
    def refused(self) -> bool:
        """The gateway refused the request (a client that left was not refused: its 499 is
        counted as a request, not a rejection)."""
        return self.refusal is not None and self.status >= 400 and self.status != CLIENT_CLOSED

    def fits_context(self, max_model_len: int) -> bool:
        """Whether vLLM would take the request on a model of this context length: its longest
        prompt leaves room for at least one token, and for all `max_tokens` asked for."""
        return self.longest_prompt < max_model_len and (
            self.longest_prompt + (self.max_output or 0) <= max_model_len
        )

    def most_output(self, max_model_len: int) -> int:
        """The most output tokens the request can be answered with: its bound, else the
        context, per sequence. A replica's usage past it is a count it could not have made."""
        return (self.max_output or max_model_len) * self.sequences

    @property
    def held_tokens(self) -> int:
        """Tokens held against a replica's `max_inflight_tokens` while this request runs."""
        return self.input_tokens + self.expected_output * self.sequences
