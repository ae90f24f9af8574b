"""TLS: the listener's certificate, renewed in place, and the CA bundles replicas are checked
against.

The listener serves HTTPS when the policy names a certificate and its key
(`server.tls`). Kubernetes renews a mounted Secret by swapping the directory's `..data` symlink,
cert-manager by rewriting it: either way the files' identity or contents change, and the gateway
loads the new pair into the same `SSLContext` the listener was started with, so new connections
get the new certificate and open ones go on, without a restart. A pair that does not load (a key
that is not the certificate's, a file half written) is tried on a throwaway context first and
never reaches the live one: the old certificate stays, the failure is logged and counted
(`llm_tls_reload_errors_total`), and the next change is tried again.

The files are read once per change, off the event loop (a thread), non-blocking and at most
`MAX_PEM_BYTES` each: a FIFO or a device at the path is refused rather than waited on (it would
wedge every request), a huge file rather than parsed. The trial and the live load take the same
bytes (through anonymous memory files: `load_cert_chain` reads paths only), so a change between
the two cannot fail the live one. A path that stays unreadable (deleted, a symlink loop) past
`UNREADABLE_GRACE_S` is counted once, as a failure; shorter, it is a swap under way. Nothing
that goes wrong ends the watch: every failure is logged and counted, and the next change tried.

Turning TLS on or off is the listener's, which opens once: a reload that does either is logged and
takes effect at the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gateway.config.load import PolicyError
from gateway.config.schema import ListenerTlsSpec
from gateway.watched import Stamp, stamp

log = logging.getLogger("gateway.tls")

MAX_PEM_BYTES = 1 << 20  # a certificate chain or a key: a few KB; past this, refused unread
UNREADABLE_GRACE_S = 5.0  # a Secret's swap leaves a path missing for milliseconds, not seconds


class Unusable(ValueError):
    """A certificate or key path that names no regular file of a bounded size."""


def _read(path: Path) -> bytes:
    """The file's bytes: opened non-blocking (a FIFO opens at once, and is refused), a regular
    file only, at most `MAX_PEM_BYTES`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Unusable(f"{path} is not a regular file")
        chunks, size = [], 0
        while chunk := os.read(fd, MAX_PEM_BYTES + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_PEM_BYTES:
                raise Unusable(f"{path} is over {MAX_PEM_BYTES} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _memory_file(data: bytes) -> Iterator[str]:
    """A path to `data` that no other process can swap: an anonymous memory file (Linux), else
    a file in a private temporary directory."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("tls", os.MFD_CLOEXEC)
        try:
            os.write(fd, data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory() as directory:  # mode 0700
        path = Path(directory) / "pem"
        path.write_bytes(data)
        yield str(path)


def _load(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    with _memory_file(cert) as cert_path, _memory_file(key) as key_path:
        context.load_cert_chain(cert_path, key_path)


@dataclass(frozen=True)
class _Pair:
    cert: Path
    key: Path

    def stamps(self) -> tuple[Stamp | None, Stamp | None]:
        return (stamp(self.cert), stamp(self.key))

    def tried(self) -> tuple[bytes, bytes]:
        """The pair's bytes, once they loaded on a throwaway context."""
        cert, key = _read(self.cert), _read(self.key)
        _load(ssl.create_default_context(ssl.Purpose.CLIENT_AUTH), cert, key)
        return cert, key


def _pair(spec: ListenerTlsSpec, base: Path) -> _Pair:
    return _Pair(base / spec.cert_file, base / spec.key_file)


class ListenerTls:
    """The listener's `SSLContext` and the files it was loaded from."""

    def __init__(self, spec: ListenerTlsSpec, base: Path) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._pair = _pair(spec, base)
        try:
            self._seen = self._pair.stamps()
            _load(self.context, _read(self._pair.cert), _read(self._pair.key))
        except (OSError, ssl.SSLError, Unusable) as exc:  # no start without the certificate
            raise PolicyError([f"server.tls: cannot load {self._pair.cert}: {exc}"]) from None
        self.reload_errors = 0
        self._unreadable_since: float | None = None  # when the pair's paths stopped resolving

    async def refresh(self, spec: ListenerTlsSpec | None, base: Path) -> None:
        """Load the policy's pair if it changed (its files, or which files); keep the running
        one if the new one does not load. Called on the file watch's ticks; never raises."""
        if spec is None:
            return  # turned off by a reload: the listener keeps TLS until restarted
        pair = _pair(spec, base)
        try:
            await self._refresh(pair)
        except (OSError, ssl.SSLError, Unusable) as exc:
            self._failed(pair, str(exc))
        except Exception as exc:  # whatever it was, the watch goes on, and says so
            log.exception("TLS certificate %s: reloading failed", pair.cert)
            self._failed(pair, f"{type(exc).__name__}: {exc}")

    async def _refresh(self, pair: _Pair) -> None:
        stamps = await asyncio.to_thread(pair.stamps)
        if None in stamps:
            self._unreadable(pair)
            return
        self._unreadable_since = None
        if pair == self._pair and stamps == self._seen:
            return
        self._pair, self._seen = pair, stamps  # tried, whatever comes of it: wait for a change
        cert, key = await asyncio.to_thread(pair.tried)
        _load(self.context, cert, key)  # the bytes that loaded, a few KB: no file read here
        log.info("TLS certificate %s loaded", pair.cert)

    def _unreadable(self, pair: _Pair) -> None:
        """A path that does not resolve: a swap under way, until `UNREADABLE_GRACE_S`; then
        one failure for the whole time it stays so."""
        now = time.monotonic()
        if self._unreadable_since is None:
            self._unreadable_since = now
        elif self._unreadable_since <= now - UNREADABLE_GRACE_S:
            self._unreadable_since = float("inf")  # counted: not again until it resolves
            self._failed(pair, f"unreadable for over {UNREADABLE_GRACE_S:g}s")

    def _failed(self, pair: _Pair, why: str) -> None:
        self.reload_errors += 1
        log.error("TLS certificate %s not loaded, the running one stays: %s", pair.cert, why)


def replica_context(ca_file: str | None, base: Path) -> ssl.SSLContext | None:
    """The context `https://` replicas are verified with: the pool's CA bundle, else (None) the
    system's trust store, which the HTTP clients load themselves."""
    if ca_file is None:
        return None
    return ssl.create_default_context(cafile=base / ca_file)
