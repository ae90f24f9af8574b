"""docs/metrics-reference.md, rendered from the gateway's metrics registry: every family `/metrics`
exports, with its type, labels and help, in the order a scrape exports them.

`python -m gateway.exporter.reference > docs/metrics-reference.md` (`make metrics-reference`
runs it); tests/codebase/test_docs.py fails when the file is not what this renders now. The registry is
built as the gateway builds it (the instruments, then `gateway.exporter.export`), with no gateway behind
it: the collectors' declarations answer, nothing is scraped.
"""

from __future__ import annotations

from typing import Any

from gateway.exporter import export
from gateway.exporter.source import Source
from gateway.observability.instruments import Instruments
from gateway.observability.registry import Declared

HEADER = """\
# Metrics reference

<!-- Generated from the gateway's metrics registry by `python -m gateway.exporter.reference`
     (`make metrics-reference`); do not edit by hand: tests/codebase/test_docs.py checks it is current. -->

Every metric family `/metrics` exports, in the order a scrape lists them. A counter's samples are
named with `_total`; a histogram's are `_bucket` (with `le`), `_sum` and `_count`. Which families a
gateway exports, and what the labels hold: [api.md](api.md#metrics).

| name | type | labels | help |
|---|---|---|---|
"""


def _unscraped() -> Source:
    raise AssertionError("the metrics reference reads declarations, never a gateway")


def _row(declared: Declared[Any]) -> str:
    kind = declared().type
    name = f"{declared.name}_total" if kind == "counter" else declared.name
    labels = ", ".join(declared.labels)
    help_text = declared.help.replace("|", "\\|")
    return f"| `{name}` | {kind} | {labels} | {help_text} |\n"


def render() -> str:
    registry = Instruments().registry
    export(registry, _unscraped)
    return HEADER + "".join(_row(declared) for declared in registry.declared())


if __name__ == "__main__":
    print(render(), end="")
