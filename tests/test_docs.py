"""The docs a user reads stay true: the policy reference is what the schema renders now."""

from __future__ import annotations

from pathlib import Path

from gateway.policy.reference import render

ROOT = Path(__file__).resolve().parent.parent


def test_policy_reference_is_up_to_date() -> None:
    shipped = (ROOT / "docs" / "policy-reference.md").read_text()
    assert shipped == render(), "run `make schema`"
