"""What the exporter's collectors read: the running gateway, at each scrape and never before.

A collector is built with a way to reach the gateway, not the gateway itself: it is registered
while the gateway is still being built, and the metrics reference registers every collector with
no gateway at all (`describe` answers from the declarations alone).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from gateway.observability.registry import Declaring

if TYPE_CHECKING:
    from gateway.admit import LivePool
    from gateway.policy.compile import Policy
    from gateway.state import State


class Source(Protocol):
    """The gateway's current state, as the collectors read it."""

    @property
    def slots(self) -> Mapping[str, LivePool]: ...

    @property
    def retiring(self) -> Mapping[str, LivePool]: ...

    @property
    def policy(self) -> Policy: ...

    @property
    def state(self) -> State: ...

    @property
    def reload_errors(self) -> int: ...

    @property
    def tls_reload_errors(self) -> int: ...


class Scraped(Declaring):
    """A collector of one concern of the gateway's live state."""

    def __init__(self, source: Callable[[], Source]) -> None:
        self.source = source
