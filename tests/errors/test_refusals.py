"""One vocabulary for refusals (gateway/errors.py): every error class names a `Refusal`, the
names the alert rules and the dashboard match exist, and the documents say what the code does.

Alerts match label values as strings: a refusal renamed in the code, or a typo in a rule, would
leave an alert silently matching nothing. These tests read the chart's files, which deploy/base
renders, not a copy.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.errors import (
    METRIC_LABEL,
    BadRequest,
    Ejection,
    GatewayError,
    QueueFull,
    Refusal,
    Retryable,
    StateUnavailable,
)

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "helm" / "llm-admission-gateway" / "files"
# Where label values are written as strings: the alerts, their unit tests' input, the dashboard.
MATCHERS = [
    MONITORING / "alerts.yaml",
    MONITORING / "dashboard.json",
    ROOT / "tests" / "deploy" / "rules_test.yaml",
]
SELECTOR = re.compile(r"(llm_rejections_total|llm_replica_ejections_total)\s*\{([^}]*)\}")
REASON = re.compile(r"""\breason\s*(=~|!~|!=|=)\s*\\?["']([^"'\\]*)\\?["']""")


def _classes(cls: type[GatewayError] = GatewayError) -> Iterator[type[GatewayError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _classes(sub)


def _refusing_classes() -> list[type[GatewayError]]:
    """Every class the gateway raises a refusal as (`Retryable` is only a base; classes tests
    make are not the gateway's)."""
    ours = (c for c in _classes() if c.__module__.startswith("gateway.") and c is not Retryable)
    return [GatewayError, *ours]


def _matched(text: str) -> Iterator[tuple[str, str]]:
    """(metric, reason value) for each value a selector of the two metrics names."""
    for metric, matchers in SELECTOR.findall(text):
        for _, values in REASON.findall(matchers):
            for value in values.split("|"):
                yield metric, value


def test_every_error_class_names_a_refusal_and_every_refusal_has_a_class() -> None:
    classes = _refusing_classes()
    assert StateUnavailable in classes
    for cls in classes:
        assert isinstance(cls.refusal, Refusal), cls
        assert cls.code == cls.refusal.value, cls
    named = {cls.refusal for cls in classes}
    assert set(Refusal) - named == {Refusal.CLIENT_DISCONNECT}  # the one that is no error


def test_classes_sharing_a_refusal_tell_the_client_the_same() -> None:
    seen: dict[Refusal, tuple[int, str, bool | None]] = {}
    for cls in _refusing_classes():
        told = (cls.status, cls.type, cls.retry)
        assert seen.setdefault(cls.refusal, told) == told, cls


def test_a_class_cannot_name_its_own_code_or_label() -> None:
    with pytest.raises(TypeError, match="declare `refusal`"):
        type("Own", (GatewayError,), {"code": "own"})
    with pytest.raises(TypeError, match="declare `refusal`"):
        type("Own", (QueueFull,), {"reason": "own"})


def test_labels_are_unique_and_the_compatibility_map_only_renames() -> None:
    labels = [r.label for r in Refusal]
    assert len(set(labels)) == len(labels)
    assert all(label != refusal.value for refusal, label in METRIC_LABEL.items())
    assert not set(METRIC_LABEL.values()) & {r.value for r in Refusal}  # no label is a name


def test_a_bad_requests_detail_is_its_code_and_its_label_the_familys() -> None:
    error = BadRequest("too many parts", code="too_many_parts")
    assert (error.code, error.refusal.label) == ("too_many_parts", "bad_request")
    assert BadRequest("x").code == "invalid_request"


def test_only_room_refusals_count_as_demand_and_only_the_replicas_failures_eject() -> None:
    assert {r for r in Refusal if r.counts_as_demand} == {
        Refusal.QUEUE_FULL, Refusal.SHED, Refusal.QUEUE_TIMEOUT, Refusal.QUEUE_WAIT_TOO_LONG,
        Refusal.SLO_UNREACHABLE, Refusal.PREEMPTED,
    }  # fmt: skip
    assert {r: r.ejection for r in Refusal if r.ejection is not None} == {
        Refusal.UPSTREAM_ERROR: Ejection.UPSTREAM_ERROR,
        Refusal.UPSTREAM_TIMEOUT: Ejection.UPSTREAM_TIMEOUT,
    }


@pytest.mark.parametrize("path", MATCHERS, ids=lambda p: p.name)
def test_every_reason_the_rules_and_dashboard_match_is_in_the_vocabulary(path: Path) -> None:
    known = {
        "llm_rejections_total": {r.label for r in Refusal if r is not Refusal.CLIENT_DISCONNECT},
        "llm_replica_ejections_total": {e.value for e in Ejection},
    }
    found = list(_matched(path.read_text()))
    unknown = sorted({(m, v) for m, v in found if v not in known[m]})
    assert not unknown, f"{path.name} matches reasons no code emits: {unknown}"
    if path.name == "alerts.yaml":  # the scan itself must see the alerts' lists
        assert ("llm_rejections_total", "queue_wait") in found


def test_the_scan_sees_every_form_of_matcher() -> None:
    text = (
        'llm_rejections_total{pool="a", reason=~"shed|queue_full"} '
        'llm_replica_ejections_total{reason!=\\"slow\\"} llm_rejections_total{reason="x"}'
    )
    assert list(_matched(text)) == [
        ("llm_rejections_total", "shed"),
        ("llm_rejections_total", "queue_full"),
        ("llm_replica_ejections_total", "slow"),
        ("llm_rejections_total", "x"),
    ]


# --- the documents --------------------------------------------------------------------------


def _retry(retry: bool | None, retryable: bool) -> str:
    if retry is None:
        return "—"
    return "`true` + `Retry-After`" if retryable else f"`{str(retry).lower()}`"


def vocabulary_table() -> list[str]:
    """docs/operations.md's table of refusals, as the code makes them."""
    first: dict[Refusal, type[GatewayError]] = {}
    for cls in _refusing_classes():
        first.setdefault(cls.refusal, cls)
    rows = []
    for refusal in Refusal:
        cls = first.get(refusal)
        if cls is None:  # client_disconnect
            rows.append(f"| `{refusal}` | 499 | — (not a refusal) | — | no | — |")
            continue
        label = f"`{refusal.label}`" + (" (older label)" if refusal in METRIC_LABEL else "")
        retry = _retry(cls.retry, issubclass(cls, Retryable))
        demand = "yes" if refusal.counts_as_demand else "no"
        ejection = f"`{refusal.ejection}`" if refusal.ejection else "—"
        rows.append(f"| `{refusal}` | {cls.status} | {label} | {retry} | {demand} | {ejection} |")
    return rows


def test_operations_md_lists_every_refusal_as_the_code_makes_it() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    rows = vocabulary_table()
    missing = [row for row in rows if row not in text.splitlines()]
    assert not missing, "docs/operations.md's refusal table differs; expected rows:\n" + "\n".join(
        missing
    )
    ejections = [f"`{e}`" for e in Ejection]
    assert all(name in text for name in ejections)


def _bad_request_details() -> set[str]:
    """Every `code="..."` a `BadRequest` is raised with, read from the source."""
    found: set[str] = set()
    for path in (ROOT / "gateway").rglob("*.py"):
        found |= set(re.findall(r'\bcode="([a-z_]+)"', path.read_text()))
    return found


def test_every_bad_request_detail_is_in_the_api_docs_error_table() -> None:
    details = _bad_request_details()
    assert {"too_many_parts", "images_not_supported", "invalid_json"} <= details
    api = (ROOT / "docs" / "api.md").read_text()
    table = [line for line in api.splitlines() if line.startswith("| 400")]
    missing = sorted(c for c in details if not any(f"`{c}`" in row for row in table))
    assert not missing, f"docs/api.md's error table lacks the 400 details {missing}"
