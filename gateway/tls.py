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

Turning TLS on or off is the listener's, which opens once: a reload that does either is logged and
takes effect at the next start.
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from gateway.policy.load import PolicyError
from gateway.policy.schema import ListenerTlsSpec

log = logging.getLogger("gateway.tls")


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What changes when a file is renewed: the inode it resolves to (a symlink swap), its
    modification time and size (a rewrite); None while it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


@dataclass(frozen=True)
class _Pair:
    cert: Path
    key: Path

    def stamps(self) -> tuple[tuple[int, int, int] | None, ...]:
        return (_stamp(self.cert), _stamp(self.key))


def _pair(spec: ListenerTlsSpec, base: Path) -> _Pair:
    return _Pair(base / spec.cert_file, base / spec.key_file)


class ListenerTls:
    """The listener's `SSLContext` and the files it was loaded from."""

    def __init__(self, spec: ListenerTlsSpec, base: Path) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._pair = _pair(spec, base)
        try:
            self.context.load_cert_chain(self._pair.cert, self._pair.key)
        except (OSError, ssl.SSLError) as exc:  # no start without the listener's certificate
            raise PolicyError([f"server.tls: cannot load {self._pair.cert}: {exc}"]) from None
        self._seen = self._pair.stamps()
        self.reload_errors = 0

    def refresh(self, spec: ListenerTlsSpec | None, base: Path) -> None:
        """Load the policy's pair if it changed (its files, or which files); keep the running
        one if the new one does not load. Called on the file watch's ticks."""
        if spec is None:
            return  # turned off by a reload: the listener keeps TLS until restarted
        pair = _pair(spec, base)
        stamps = pair.stamps()
        if pair == self._pair and stamps == self._seen:
            return
        if None in stamps:
            return  # mid-swap: the next tick sees the whole pair
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(pair.cert, pair.key)
        except (OSError, ssl.SSLError) as exc:
            self.reload_errors += 1
            log.error("TLS certificate %s not loaded, the running one stays: %s", pair.cert, exc)
            self._pair, self._seen = pair, stamps  # tried: wait for the next change
            return
        self.context.load_cert_chain(pair.cert, pair.key)
        self._pair, self._seen = pair, stamps
        log.info("TLS certificate %s loaded", pair.cert)


def replica_context(ca_file: str | None, base: Path) -> ssl.SSLContext | None:
    """The context `https://` replicas are verified with: the pool's CA bundle, else (None) the
    system's trust store, which the HTTP clients load themselves."""
    if ca_file is None:
        return None
    return ssl.create_default_context(cafile=base / ca_file)
