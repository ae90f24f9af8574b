"""`/metrics`'s answer, the gateway's own scrape and a pod's (gateway/server/workers.py)."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics


def exposition(request: web.Request, registry: Any) -> web.Response:
    """`registry`'s metrics in Prometheus's text format, or OpenMetrics when the scraper asks
    for it (Prometheus does with exemplar storage on): only OpenMetrics shows the latency
    histograms' exemplars, the trace of a request that fell in each bucket."""
    if "application/openmetrics-text" in request.headers.get("Accept", ""):
        body = openmetrics.generate_latest(registry)  # type: ignore[no-untyped-call]
        content_type = openmetrics.CONTENT_TYPE_LATEST
    else:
        body, content_type = generate_latest(registry), CONTENT_TYPE_LATEST
    return web.Response(body=body, headers={"Content-Type": content_type})
