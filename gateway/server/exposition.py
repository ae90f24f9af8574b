"""`/metrics`'s answer, the gateway's own scrape and a pod's (gateway/server/workers.py).

A busy gateway's scrape is a thousand lines and more, and prometheus-client builds and writes
them in Python: done in one go on the event loop, every scrape held it for tens of
milliseconds, and Prometheus, a dashboard and a probe scrape all day. So the collectors run on
the loop, because they read its live state (pools, queues, windows), but one at a time with the
loop free in between, and the families they return, the scrape's own objects, are written out on
a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector


class Families:
    """What prometheus-client's writers read: fixed families, collected once."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> list[Metric]:
        return self._families


async def collected(collectors: Iterable[Collector]) -> Families:
    """Every collector's families in order, one collector a turn of the loop."""
    families: list[Metric] = []
    for collector in collectors:
        families.extend(collector.collect())
        await asyncio.sleep(0)
    return Families(families)


def written(families: Families, accept: str) -> tuple[bytes, str]:
    """The families in Prometheus's text format, or OpenMetrics when the scraper asks for it
    (Prometheus does with exemplar storage on): only OpenMetrics shows the latency histograms'
    exemplars, the trace of a request that fell in each bucket."""
    if "application/openmetrics-text" in accept:
        body = openmetrics.generate_latest(families)  # type: ignore[no-untyped-call]
        return body, openmetrics.CONTENT_TYPE_LATEST
    return generate_latest(families), CONTENT_TYPE_LATEST


async def exposition(request: web.Request, families: Families) -> web.Response:
    """`families` written for `request`'s scraper on a thread: nothing the loop still changes."""
    accept = request.headers.get("Accept", "")
    body, content_type = await asyncio.to_thread(written, families, accept)
    return web.Response(body=body, headers={"Content-Type": content_type})
