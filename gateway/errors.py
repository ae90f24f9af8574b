"""Every refusal the gateway makes, named once, and every error it returns, in one tree.

`Refusal` is the vocabulary: one name a refusal, and the name is what the client's `error.code`
says, what the access log's `reason` says, and (through `METRIC_LABEL`, for the few kept under
their older label) the `reason` label of `llm_rejections_total`. Alert rules and the dashboard
match those labels; tests/errors/test_refusals.py checks that every name they use is one of these, so a
rename cannot silently blind an alert. What the gateway's own machinery asks of a refusal (is it
unmet demand for the autoscaler, is it the replica's failure) is a property of the name, here,
instead of a set of names written where it is asked.

A `GatewayError` subclass declares its `refusal`; its `code` follows from it. A stage raises
one; the pipeline turns it into `{"error": {"message", "type", "param", "code"}}` with the
class's status (and `Retry-After` for retryable refusals). `BadRequest` alone may say more: its
per-raise `code` (`too_many_parts`, `images_not_supported`, ...) is a detail of the one refusal
`invalid_request`, told to the client and logged, and counted under that refusal's label.

`Ejection` is a separate, smaller set: why a replica was taken out of its pool, the `reason`
label of `llm_replica_ejections_total`. Two of its names are refusals' own (a stream a replica
broke is held against it under the refusal's name), which is why it lives here.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any, ClassVar

import orjson
from aiohttp import web


class Refusal(StrEnum):
    """One name for each refusal: the client's `error.code`, the access log's `reason`, and,
    but for `METRIC_LABEL`'s few, the `reason` label of `llm_rejections_total`."""

    # The request itself (sent again, it is refused again).
    INVALID_REQUEST = "invalid_request"  # a malformed or invalid field; `BadRequest`'s details
    MALFORMED_REQUEST = "malformed_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MAX_OUTPUT_TOKENS_EXCEEDED = "max_output_tokens_exceeded"  # over its pool's output bound
    NO_ROUTE = "no_route"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    REQUEST_TOO_LARGE = "request_too_large"
    HEADERS_TOO_LARGE = "headers_too_large"
    REQUEST_TIMEOUT = "request_timeout"
    MODEL_NOT_FOUND = "model_not_found"
    RESPONSE_NOT_FOUND = "response_not_found"  # a stored response unknown, or its replica gone
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    INVALID_API_KEY = "invalid_api_key"  # a tenant's key, or the admin token
    ADMIN_DISABLED = "admin_disabled"
    INVALID_POLICY = "invalid_policy"
    # The tenant's windows.
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    REQUEST_OVER_LIMIT = "request_over_limit"
    # The pool's room: unmet demand.
    QUEUE_FULL = "queue_full"
    SHED = "shed"
    QUEUE_TIMEOUT = "queue_timeout"
    QUEUE_WAIT_TOO_LONG = "queue_wait_too_long"
    SLO_UNREACHABLE = "slo_unreachable"  # a sheddable request no replica would serve in time
    PREEMPTED = "preempted"  # cancelled in flight for a critical request (`slo.preempt`)
    # The service.
    NO_REPLICA = "no_replica"
    SHUTTING_DOWN = "shutting_down"
    STARTING = "starting"  # the policy and its tokenizers still loading: nothing served yet
    STATE_UNAVAILABLE = "state_unavailable"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    RESPONSE_TOO_LARGE = "response_too_large"
    TOTAL_TIMEOUT = "total_timeout"
    INTERNAL_ERROR = "internal_error"
    RELOAD_FAILED = "reload_failed"
    # Not a refusal: the client left (499) before its whole answer was written. Named here
    # because the access log reports it where it reports refusals; never in
    # `llm_rejections_total` (`account` counts no 499) and no `GatewayError`.
    CLIENT_DISCONNECT = "client_disconnect"

    @property
    def label(self) -> str:
        """The `reason` label of `llm_rejections_total`: the name, or its older label."""
        return METRIC_LABEL.get(self, self.value)

    @property
    def counts_as_demand(self) -> bool:
        """A request the pool had no room for: the autoscaler's demand signal counts it
        (`LivePool.slot`), as it counts the requests it served."""
        return self in _DEMAND

    @property
    def ejection(self) -> Ejection | None:
        """The replica's failure, held against it (`LivePool.failed`) when it ends an answer
        the replica had begun (a broken stream); None for every refusal that is not the
        replica's doing (`response_too_large`, `total_timeout`: the request's own size or
        time limit)."""
        return _EJECTION.get(self)


# Labels of `llm_rejections_total` that predate the one vocabulary, kept so the dashboards and
# alerts of existing deployments keep matching: the metric says these, the client's code and
# the access log say the name. A new refusal gets no entry: its label is its name.
METRIC_LABEL: dict[Refusal, str] = {
    Refusal.INVALID_REQUEST: "bad_request",
    Refusal.CONTEXT_LENGTH_EXCEEDED: "context_length",
    Refusal.REQUEST_TOO_LARGE: "body_too_large",
    Refusal.REQUEST_TIMEOUT: "body_timeout",
    Refusal.RATE_LIMIT_EXCEEDED: "quota_exceeded",
    Refusal.REQUEST_OVER_LIMIT: "over_quota",
    Refusal.QUEUE_WAIT_TOO_LONG: "queue_wait",
}

_DEMAND = frozenset(
    {
        Refusal.QUEUE_FULL,
        Refusal.SHED,
        Refusal.QUEUE_TIMEOUT,
        Refusal.QUEUE_WAIT_TOO_LONG,
        Refusal.SLO_UNREACHABLE,
        Refusal.PREEMPTED,
    }
)


class Ejection(StrEnum):
    """Why a replica was counted failed, the `reason` label of `llm_replica_ejections_total`
    (and of the log line that ejects it). Not refusals: a failure before the answer's first
    byte is named by how the replica failed, one after it by the refusal the client's stream
    ended with. So a replica that stalls is `timeout` before its first byte and
    `upstream_timeout` after; both names are kept as dashboards already know them."""

    REFUSED = "refused"  # closed, reset or 503 before it took the request (retried elsewhere)
    TIMEOUT = "timeout"  # no answer within the pool's time-outs
    UPSTREAM_ERROR = "upstream_error"  # broke before, or broke its stream after, the first byte
    UPSTREAM_TIMEOUT = "upstream_timeout"  # went silent in a stream it had begun
    STATUS_5XX = "5xx"  # answered with its own 5xx (relayed to the client as it is)
    HEALTH_CHECK = "health_check"  # failed its `/health` probe
    SLOW = "slow"  # decoded under `slow_ratio` of its peers' median for `slow_window_s`


_EJECTION = {
    Refusal.UPSTREAM_ERROR: Ejection.UPSTREAM_ERROR,
    Refusal.UPSTREAM_TIMEOUT: Ejection.UPSTREAM_TIMEOUT,
}


class GatewayError(Exception):
    """Base of every refusal the gateway makes on purpose; itself the 500 of a bug.

    A subclass declares its `refusal` (its `code` follows) and what the client is sent: its
    `status`, `type` and `retry`."""

    refusal: ClassVar[Refusal] = Refusal.INTERNAL_ERROR
    code: str = Refusal.INTERNAL_ERROR.value  # the client's `error.code`: the refusal's name
    status = 500
    type = "internal_error"
    # What `x-should-retry` tells clients (the OpenAI SDKs obey it over their own rule, which
    # retries every 429 and 5xx): False where the same request can only fail the same way.
    retry: bool | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A class naming its own code or label would start a second vocabulary.
        for own in ("code", "reason"):
            if own in cls.__dict__:
                raise TypeError(f"{cls.__name__} sets `{own}`: declare `refusal` instead")
        cls.code = cls.refusal.value

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def headers(self) -> dict[str, str]:
        if self.retry is None:
            return {}
        return {"x-should-retry": "true" if self.retry else "false"}

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)

    def response(self, extra_headers: dict[str, str] | None = None) -> web.Response:
        headers = {**self.headers(), **(extra_headers or {})}
        return web.Response(
            status=self.status, body=self.body(), content_type="application/json", headers=headers
        )


def error_body(message: str, type_: str, code: str | int, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


class BadRequest(GatewayError):
    """Raised when the request is malformed or asks for something invalid.

    One refusal, `invalid_request`, with details: a raise may pass its own `code` (`invalid_json`,
    `too_many_parts`, `images_not_supported`, ...), which the client is told and the access log
    reports, so a client can tell which limit it met; the metric counts them all under the
    refusal's one label, `bad_request`, keeping its cardinality to the vocabulary's. Every
    detail is in docs/api.md's error table (tests/errors/test_refusals.py checks it)."""

    refusal = Refusal.INVALID_REQUEST
    status = 400
    type = "invalid_request_error"
    retry = False  # the request itself is refused: sent again, it is again

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, param=param)
        if code is not None:
            self.code = code


class MalformedRequest(BadRequest):
    """Raised when the request head is not valid HTTP/1.1 or holds bytes that cannot be forwarded."""

    refusal = Refusal.MALFORMED_REQUEST


class ContextLengthExceeded(BadRequest):
    """Raised when input + output tokens exceed the model's `max_model_len` (vLLM would refuse)."""

    refusal = Refusal.CONTEXT_LENGTH_EXCEEDED


class MaxOutputTokensExceeded(BadRequest):
    """Raised when the output a request asks for is over its pool's `max_output_tokens`."""

    refusal = Refusal.MAX_OUTPUT_TOKENS_EXCEEDED


class NoRoute(BadRequest):
    """Raised when the model is served but no route accepts this request's class or shape."""

    refusal = Refusal.NO_ROUTE


class UnsupportedMediaType(GatewayError):
    """Raised when the body is not declared as JSON."""

    refusal = Refusal.UNSUPPORTED_MEDIA_TYPE
    status = 415
    type = "invalid_request_error"
    retry = False


class BodyTooLarge(GatewayError):
    """Raised when the body exceeds the policy's `server.max_body_bytes`."""

    refusal = Refusal.REQUEST_TOO_LARGE
    status = 413
    type = "invalid_request_error"
    retry = False


class HeadersTooLarge(GatewayError):
    """Raised when the request has more header fields, or more header bytes, than the policy allows."""

    refusal = Refusal.HEADERS_TOO_LARGE
    status = 431
    type = "invalid_request_error"
    retry = False


class RequestTimeout(GatewayError, TimeoutError):
    """Raised when the client did not finish sending its body within `server.body_timeout_s`.

    It is also a `TimeoutError` because it is set on the request's payload: aiohttp's lingering
    read after the response treats a `TimeoutError` as "stop reading" instead of logging it.
    """

    refusal = Refusal.REQUEST_TIMEOUT
    status = 408
    type = "invalid_request_error"


class ModelNotFound(GatewayError):
    """Raised when no route serves the requested model."""

    refusal = Refusal.MODEL_NOT_FOUND
    status = 404
    type = "invalid_request_error"


class ResponseNotFound(GatewayError):
    """Raised for a stored response (Responses API) the gateway knows no replica of, for this
    tenant: never made, forgotten, another tenant's, or held by a replica that has left."""

    refusal = Refusal.RESPONSE_NOT_FOUND
    status = 404
    type = "invalid_request_error"


class NotFound(GatewayError):
    """Raised for any path the gateway does not serve: it is not an open proxy."""

    refusal = Refusal.NOT_FOUND
    status = 404
    type = "invalid_request_error"


class MethodNotAllowed(GatewayError):
    """Raised for a known path with the wrong method."""

    refusal = Refusal.METHOD_NOT_ALLOWED
    status = 405
    type = "invalid_request_error"


class Unauthorized(GatewayError):
    """Raised when an admin call lacks the right bearer token."""

    refusal = Refusal.INVALID_API_KEY
    status = 401
    type = "invalid_request_error"


class InvalidApiKey(Unauthorized):
    """Raised when tenants are configured and the request's bearer key is missing or unknown."""


class AdminDisabled(GatewayError):
    """Raised for admin calls while no admin token is configured."""

    refusal = Refusal.ADMIN_DISABLED
    status = 403
    type = "invalid_request_error"


class InvalidPolicy(GatewayError):
    """Raised when a reload finds the policy file invalid; the running policy stays."""

    refusal = Refusal.INVALID_POLICY
    status = 422
    type = "invalid_request_error"


class ReloadFailed(GatewayError):
    """Raised when a reload fails for a reason other than the file's content (a bug, or the
    machine): said in the error shape, so an operator's tooling reads it like any refusal."""

    refusal = Refusal.RELOAD_FAILED


class Retryable(GatewayError):
    """A refusal the client should retry after `retry_after_s` seconds."""

    retry = True

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class QueueFull(Retryable):
    """Raised when every replica is at its cap and the pool's queue is at `max_depth`."""

    refusal = Refusal.QUEUE_FULL
    status = 429
    type = "rate_limit_error"


class Shed(Retryable):
    """Raised when the pool is saturated past the request's tier threshold: lower tiers go first."""

    refusal = Refusal.SHED
    status = 429
    type = "rate_limit_error"


class QueueTimeout(Retryable):
    """Raised when a queued request waited `max_wait_s` without a free slot."""

    refusal = Refusal.QUEUE_TIMEOUT
    status = 429
    type = "rate_limit_error"


class QueueWaitTooLong(Retryable):
    """Raised at once when the predicted queue wait is confidently over `max_wait_s`: the client
    learns now, with the prediction as Retry-After, what it would learn at the time-out."""

    refusal = Refusal.QUEUE_WAIT_TOO_LONG
    status = 429
    type = "rate_limit_error"


class SloUnreachable(Retryable):
    """Raised at once for a sheddable request that no replica is predicted to serve within its
    objective: refused now, with the prediction, rather than served late at the cost of the
    requests that can still meet theirs."""

    refusal = Refusal.SLO_UNREACHABLE
    status = 429
    type = "rate_limit_error"


class Preempted(Retryable):
    """Raised when a sheddable request in flight was cancelled to make room for a critical one
    (`slo.preempt`): retryable, and charged only what it was delivered."""

    refusal = Refusal.PREEMPTED
    status = 429
    type = "rate_limit_error"


class QuotaExceeded(Retryable):
    """Raised when the tenant's TPM or RPM window has no room for this request yet."""

    refusal = Refusal.RATE_LIMIT_EXCEEDED
    status = 429
    type = "rate_limit_error"


class OverQuota(GatewayError):
    """Raised when one request needs more tokens than the tenant's whole TPM: no wait helps."""

    refusal = Refusal.REQUEST_OVER_LIMIT
    status = 429
    type = "rate_limit_error"
    retry = False


class NoReplica(Retryable):
    """Raised when the routed pool has no replica at all."""

    refusal = Refusal.NO_REPLICA
    status = 503
    type = "service_unavailable_error"


class ShuttingDown(Retryable):
    """Raised for new requests that arrive while the gateway drains."""

    refusal = Refusal.SHUTTING_DOWN
    status = 503
    type = "service_unavailable_error"


class Starting(Retryable):
    """Raised for requests that arrive while the gateway loads its policy and tokenizers: its
    listener answers the probes then (`/healthz` alive, `/readyz` not ready) and nothing else."""

    refusal = Refusal.STARTING
    status = 503
    type = "service_unavailable_error"


class StateUnavailable(Retryable):
    """Raised when the shared state cannot be reached and the policy says `on_failure: closed`:
    the state raises its own `StateUnreachable` (it knows no HTTP), and the stages that call it
    (the quota stage, the slot leases) turn it into this refusal."""

    refusal = Refusal.STATE_UNAVAILABLE
    status = 503
    type = "service_unavailable_error"


class UpstreamError(GatewayError):
    """Raised when the replica could not be reached or broke before any byte reached the client."""

    refusal = Refusal.UPSTREAM_ERROR
    status = 502
    type = "upstream_error"


class ReplicaRefused(UpstreamError):
    """Raised when the replica failed before it took the request (refused, reset, 503): safe to
    retry on another replica."""


class ResponseTooLarge(GatewayError):
    """Raised when a replica's whole (non-streamed) answer is over `server.max_response_bytes`;
    not an `UpstreamError`, so not held against the replica: a client can ask for a huge answer."""

    refusal = Refusal.RESPONSE_TOO_LARGE
    status = 502
    type = "upstream_error"
    retry = False


class UpstreamTimeout(GatewayError):
    """Raised when the replica did not answer within the pool's time-outs."""

    refusal = Refusal.UPSTREAM_TIMEOUT
    status = 504
    type = "upstream_error"


class TotalTimeout(GatewayError):
    """Raised when a request ran out its own time limit, the pool's `total_s`: a long answer, not
    a replica failing (its silence is `read_s`'s to judge, a stream's start `first_token_s`'s).
    Not an `UpstreamTimeout`, so not held against the replica."""

    refusal = Refusal.TOTAL_TIMEOUT
    status = 504
    type = "upstream_error"
    retry = False
