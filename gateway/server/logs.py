"""Logs that hostile traffic can neither flood nor use to leak secrets.

aiohttp's server logger (`aiohttp.server`) writes an ERROR with a traceback for every request head
its parser refuses, and the parser's messages quote the offending bytes: a bare-LF head or a NUL in
`Authorization` put the tenant key or the admin token into the log, and 2,000 such requests wrote
800 KB. `ServerLogFilter` sits on that logger, so it covers every runner (the CLI's, the tests',
an embedder's) and every path that logs there, not only the ones the gateway overrides: each
record becomes one line that names the exception's class and never its message, rate-limited.

OpenTelemetry's propagator does the same with a request's trace context: a WARNING for every
`traceparent` over its length, every `tracestate` too long or malformed, the latter quoting the
member (a key is one header away). `TraceContextLogFilter` sits on those loggers: rate-limited,
and no string the client sent is kept.

`RateLimited` is the shared limiter: at most `burst` lines per key per `interval_s`; the next line
after a quiet spell says how many were suppressed. Keys are fixed strings from the code, so the
table is bounded by construction.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp.http_exceptions import HttpProcessingError

SERVER_LOGGER = "aiohttp.server"
# Where OpenTelemetry logs about the `traceparent` and `tracestate` it extracts.
TRACECONTEXT_LOGGERS = ("opentelemetry.trace.propagation.tracecontext", "opentelemetry.trace.span")
# A head the parser refused, or a client that left while its answer was being written (the
# handler re-raises that so aiohttp closes the connection): nothing for an operator to fix.
_CLIENTS_FAULT = (HttpProcessingError, ConnectionError)


@dataclass(slots=True)
class _Window:
    start: float
    lines: int = 0
    suppressed: int = 0


class RateLimited:
    """At most `burst` lines per key in each `interval_s` window."""

    def __init__(
        self, burst: int = 10, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst = burst
        self.interval_s = interval_s
        self._clock = clock
        self._windows: dict[str, _Window] = {}

    def allow(self, key: str) -> int | None:
        """None: drop this line; else how many lines of `key` were dropped before it."""
        now = self._clock()
        window = self._windows.get(key)
        if window is None or now - window.start >= self.interval_s:
            suppressed = window.suppressed if window is not None else 0
            self._windows[key] = _Window(now, 1)
            return suppressed
        if window.lines < self.burst:
            window.lines += 1
            return 0
        window.suppressed += 1
        return None

    def warning(self, logger: logging.Logger, key: str, message: str, *args: object) -> None:
        """Log one WARNING line under `key`'s budget; `args` must hold no client data."""
        suppressed = self.allow(key)
        if suppressed is None:
            return
        if suppressed:
            message += " (%d similar suppressed)"
            args = (*args, suppressed)
        logger.warning(message, *args)


def _where(exc: BaseException) -> str:
    """The innermost frame, enough to find a bug without any value from the request."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" at {last.filename}:{last.lineno} in {last.name}"


class ServerLogFilter(logging.Filter):
    """Rewrite every `aiohttp.server` record into one secret-free, rate-limited line.

    A parser refusal or a client gone mid-answer (the client's doing) becomes a WARNING; any other exception keeps its level
    and gains the innermost frame, so a gateway bug is still found. The exception's message and
    traceback are dropped in both cases: either may quote request bytes.
    """

    def __init__(self, limiter: RateLimited | None = None) -> None:
        super().__init__()
        self.limiter = limiter or RateLimited()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None and record.levelno < logging.WARNING:
            return True  # aiohttp's debug chatter quotes nothing from requests
        kind = type(exc).__name__ if exc is not None else ""
        key = f"{record.msg}|{kind}"
        suppressed = self.limiter.allow(key)
        if suppressed is None:
            return False
        message = record.getMessage()
        if isinstance(exc, _CLIENTS_FAULT):
            message += f": {kind}"
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        elif exc is not None:
            message += f": {kind}{_where(exc)}"
        if suppressed:
            message += f" ({suppressed} similar suppressed)"
        record.msg, record.args = message, None
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


class TraceContextLogFilter(logging.Filter):
    """Rate-limit OpenTelemetry's warnings about a client's `traceparent` / `tracestate`, each
    with its string arguments (the header's members) replaced: its numbers are the SDK's own."""

    def __init__(self, limiter: RateLimited | None = None) -> None:
        super().__init__()
        self.limiter = limiter or RateLimited()

    def filter(self, record: logging.LogRecord) -> bool:
        suppressed = self.limiter.allow(f"tracecontext|{record.msg}")
        if suppressed is None:
            return False
        args = record.args if isinstance(record.args, tuple) else ()
        kept = tuple(a if isinstance(a, int | float) else "(not logged)" for a in args)
        try:
            message = str(record.msg) % kept if kept else str(record.msg)
        except (TypeError, ValueError):
            message = str(record.msg)
        message = f"a request's trace context: {message}"
        if suppressed:
            message += f" ({suppressed} similar suppressed)"
        record.msg, record.args = message, None
        return True


def install() -> None:
    """Put one `ServerLogFilter` on aiohttp's server logger and one `TraceContextLogFilter` on
    each of OpenTelemetry's that read client headers (idempotent)."""
    filters: list[tuple[str, type[ServerLogFilter | TraceContextLogFilter]]] = [
        (SERVER_LOGGER, ServerLogFilter),
        *((name, TraceContextLogFilter) for name in TRACECONTEXT_LOGGERS),
    ]
    for name, kind in filters:
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
