"""Every error the gateway returns, in one tree, rendered in one place in the OpenAI shape.

A stage raises a `GatewayError`; the pipeline turns it into `{"error": {"message", "type", "param",
"code"}}` with the right status (and `Retry-After` for retryable refusals). `reason` is the bounded
label value of `llm_rejections_total` (alerts match it); the access log reports `code`, what the
client was told.
"""

from __future__ import annotations

import math

import orjson
from aiohttp import web


class GatewayError(Exception):
    """Base of every refusal the gateway makes on purpose."""

    status = 500
    type = "internal_error"
    code = "internal_error"
    reason = "internal_error"
    # What `x-should-retry` tells clients (the OpenAI SDKs obey it over their own rule, which
    # retries every 429 and 5xx): False where the same request can only fail the same way.
    retry: bool | None = None

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
    """Raised when the request is malformed or asks for something invalid."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"
    retry = False  # the request itself is refused: sent again, it is again
    reason = "bad_request"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, param=param)
        if code is not None:
            self.code = code


class MalformedRequest(BadRequest):
    """Raised when the request head is not valid HTTP/1.1 or holds bytes that cannot be forwarded."""

    code = "malformed_request"
    reason = "malformed_request"


class ContextLengthExceeded(BadRequest):
    """Raised when input + output tokens exceed the model's `max_model_len` (vLLM would refuse)."""

    code = "context_length_exceeded"
    reason = "context_length"


class NoRoute(BadRequest):
    """Raised when the model is served but no route accepts this request's class or shape."""

    code = "no_route"
    reason = "no_route"


class UnsupportedMediaType(GatewayError):
    """Raised when the body is not declared as JSON."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"
    retry = False
    reason = "unsupported_media_type"


class BodyTooLarge(GatewayError):
    """Raised when the body exceeds the policy's `server.max_body_bytes`."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"
    retry = False
    reason = "body_too_large"


class HeadersTooLarge(GatewayError):
    """Raised when the request has more header fields, or more header bytes, than the policy allows."""

    status = 431
    type = "invalid_request_error"
    code = "headers_too_large"
    retry = False
    reason = "headers_too_large"


class RequestTimeout(GatewayError, TimeoutError):
    """Raised when the client did not finish sending its body within `server.body_timeout_s`.

    It is also a `TimeoutError` because it is set on the request's payload: aiohttp's lingering
    read after the response treats a `TimeoutError` as "stop reading" instead of logging it.
    """

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"
    reason = "body_timeout"


class ModelNotFound(GatewayError):
    """Raised when no route serves the requested model."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"
    reason = "model_not_found"


class NotFound(GatewayError):
    """Raised for any path the gateway does not serve: it is not an open proxy."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"
    reason = "not_found"


class MethodNotAllowed(GatewayError):
    """Raised for a known path with the wrong method."""

    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"
    reason = "method_not_allowed"


class Unauthorized(GatewayError):
    """Raised when an admin call lacks the right bearer token."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    reason = "unauthorized"


class InvalidApiKey(Unauthorized):
    """Raised when tenants are configured and the request's bearer key is missing or unknown."""

    reason = "invalid_api_key"


class AdminDisabled(GatewayError):
    """Raised for admin calls while no admin token is configured."""

    status = 403
    type = "invalid_request_error"
    code = "admin_disabled"
    reason = "admin_disabled"


class InvalidPolicy(GatewayError):
    """Raised when a reload finds the policy file invalid; the running policy stays."""

    status = 422
    type = "invalid_request_error"
    code = "invalid_policy"
    reason = "invalid_policy"


class ReloadFailed(GatewayError):
    """Raised when a reload fails for a reason other than the file's content (a bug, or the
    machine): said in the error shape, so an operator's tooling reads it like any refusal."""

    code = "reload_failed"
    reason = "reload_failed"


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

    status = 429
    type = "rate_limit_error"
    code = "queue_full"
    reason = "queue_full"


class Shed(Retryable):
    """Raised when the pool is saturated past the request's tier threshold: lower tiers go first."""

    status = 429
    type = "rate_limit_error"
    code = "shed"
    reason = "shed"


class QueueTimeout(Retryable):
    """Raised when a queued request waited `max_wait_s` without a free slot."""

    status = 429
    type = "rate_limit_error"
    code = "queue_timeout"
    reason = "queue_timeout"


class QueueWaitTooLong(Retryable):
    """Raised at once when the predicted queue wait is confidently over `max_wait_s`: the client
    learns now, with the prediction as Retry-After, what it would learn at the time-out."""

    status = 429
    type = "rate_limit_error"
    code = "queue_wait_too_long"
    reason = "queue_wait"


class QuotaExceeded(Retryable):
    """Raised when the tenant's TPM or RPM window has no room for this request yet."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    reason = "quota_exceeded"


class OverQuota(GatewayError):
    """Raised when one request needs more tokens than the tenant's whole TPM: no wait helps."""

    status = 429
    type = "rate_limit_error"
    code = "request_over_limit"
    retry = False
    reason = "over_quota"


class NoReplica(Retryable):
    """Raised when the routed pool has no replica at all."""

    status = 503
    type = "service_unavailable_error"
    code = "no_replica"
    reason = "no_replica"


class ShuttingDown(Retryable):
    """Raised for new requests that arrive while the gateway drains."""

    status = 503
    type = "service_unavailable_error"
    code = "shutting_down"
    reason = "shutting_down"


class UpstreamError(GatewayError):
    """Raised when the replica could not be reached or broke before any byte reached the client."""

    status = 502
    type = "upstream_error"
    code = "upstream_error"
    reason = "upstream_error"


class ReplicaRefused(UpstreamError):
    """Raised when the replica failed before it took the request (refused, reset, 503): safe to
    retry on another replica."""


class ResponseTooLarge(GatewayError):
    """Raised when a replica's whole (non-streamed) answer is over `server.max_response_bytes`;
    not an `UpstreamError`, so not held against the replica: a client can ask for a huge answer."""

    status = 502
    type = "upstream_error"
    code = "response_too_large"
    retry = False
    reason = "response_too_large"


class UpstreamTimeout(GatewayError):
    """Raised when the replica did not answer within the pool's time-outs."""

    status = 504
    type = "upstream_error"
    code = "upstream_timeout"
    reason = "upstream_timeout"


class TotalTimeout(GatewayError):
    """Raised when a request ran out its own time limit, the pool's `total_s`: a long answer, not
    a replica failing (its silence is `read_s`'s to judge, a stream's start `first_token_s`'s).
    Not an `UpstreamTimeout`, so not held against the replica."""

    status = 504
    type = "upstream_error"
    code = "total_timeout"
    retry = False
    reason = "total_timeout"
