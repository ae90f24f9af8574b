"""The docs a user reads stay true: the policy reference is what the schema renders now, the
metrics reference what the metrics registry renders now, every relative link in a Markdown file
leads to a file (and heading) that exists, and the README's minimal policy is the shipped one."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.config.reference import render
from gateway.exporter import reference as metrics_reference

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def test_policy_reference_is_up_to_date() -> None:
    shipped = (ROOT / "docs" / "policy-reference.md").read_text()
    assert shipped == render(), "run `make schema`"


def test_metrics_reference_is_up_to_date() -> None:
    shipped = (ROOT / "docs" / "metrics-reference.md").read_text()
    assert shipped == metrics_reference.render(), "run `make metrics-reference`"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, a repeated
    one numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return out


def test_relative_links_resolve() -> None:
    broken = []
    for doc in DOCS:
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_readmes_minimal_policy_is_the_shipped_file() -> None:
    readme = (ROOT / "README.md").read_text()
    shown = readme.split("### A minimal policy", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    assert shown == (ROOT / "policies" / "minimal.yaml").read_text()
