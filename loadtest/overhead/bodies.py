"""The requests `loadtest.bench_overhead` sends, built here so every target gets the same bytes.

(a) a short chat, (b) a ~4,000-token classification chat (tiny tokenizer) whose system message, a
rules block, repeats word for word while the user's listing varies, (c) a streamed chat of
`STREAM_TOKENS` chunks, and the prose chats of (d)/(e), every word drawn from a seeded generator
so no cache can have seen one. Bodies go out as compact JSON (`dumps`).
"""

from __future__ import annotations

import json
import random
from typing import Any

from loadtest import prose

MODEL = "bench-model"
CHAT_PATH = "/v1/chat/completions"
STREAM_TOKENS = 20
RULE_COUNT = 65  # with the tiny tokenizer: ~3,850 tokens of rules, ~4,000 with the listing
RULES_TOKENS, LISTING_TOKENS = 3000, 1000  # a counting chat's system and user messages, ~4,000


_SUBJECTS = (
    "lithium battery packs", "children's toys", "medical devices", "dietary supplements",
    "replica brand items", "knives and blades", "cosmetics", "used electronics",
    "prescription drugs", "e-cigarettes", "pet food", "car seats", "baby formula", "sunscreen",
    "phone chargers",
)  # fmt: skip
_RULES = (
    "Listings for {s} must not claim that the product will cure, treat or prevent any medical"
    " condition.",
    "Sellers of {s} must show a valid safety certificate and the certificate number in the"
    " description.",
    "A listing for {s} is prohibited if the image text (OCR) contradicts the description or the"
    " brand.",
    "Price claims for {s} such as 'lowest price' or 'was/now' must be supported by a price history"
    " of 30 days.",
    "Warranty and refund terms for {s} must be stated; a listing that says 'no refund' for {s} is"
    " allowed only for custom items.",
    "If the listing for {s} mentions a counterfeit, replica or 'inspired by' brand, label it as"
    " prohibited.",
    "Shipping of {s} by air must follow the carrier's dangerous goods rules; state the category"
    " and label number.",
)
_LISTINGS = (
    "{s}, brand new in box, ships from our warehouse in two days. Includes a one year warranty"
    " and a free carry case. Certificate number {n} is printed on the label.",
    "Second hand {s} in good condition, small scratches on the side, tested and working. No"
    " refund on used items, but we answer every question within a day.",
    "Premium {s} that doctors recommend: helps with sleep, pain and stress. Lowest price on the"
    " market, was 49.99, now 19.99, only {n} left in stock.",
    "{s} inspired by a famous designer brand, same look at a tenth of the price. Ships by air"
    " worldwide, battery included, category label {n}.",
)
_PLACEHOLDER = "@@LISTING@@"


_INSTRUCTIONS = (
    "You are a marketplace compliance reviewer. Read the rules, then classify the product"
    " listing the user gives you.\n"
    "Answer with exactly one label: ALLOW, REVIEW or PROHIBIT. Do not explain.\n"
)


def rules_block() -> str:
    """The system prompt every classification request repeats word for word."""
    lines = [_INSTRUCTIONS]
    for i in range(RULE_COUNT):
        rule = _RULES[(i * 5) % len(_RULES)]
        lines.append(f"Rule {i + 1}. " + rule.format(s=_SUBJECTS[(i * 7) % len(_SUBJECTS)]))
    return "\n".join(lines)


def listings() -> list[str]:
    """Product descriptions the classification request cycles through (a SKU makes each unique)."""
    return [
        template.format(s=subject.capitalize(), n=1000 + 37 * i)
        for i, (template, subject) in enumerate((t, s) for t in _LISTINGS for s in _SUBJECTS[:8])
    ]


def short_chat() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello to the benchmark in a few words."}],
        "max_tokens": 16,
    }


def classify_chat(listing: str, rules: str | None = None, model: str = MODEL) -> dict[str, Any]:
    """A classification request: `rules` (by default the fixed block) and a listing to label."""
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": rules_block() if rules is None else rules},
            {"role": "user", "content": f"Classify this listing.\n\n{listing}"},
        ],
        "max_tokens": 10,
        "temperature": 0,
    }


def prose_chat(model: str, chars_per_token: float, rng: random.Random) -> dict[str, Any]:
    """A classification request of ~4,000 tokens of prose, every word of it drawn from `rng`:
    ~3,000 tokens of rules, ~1,000 of listing, sized by the model's `chars_per_token`."""
    rules = prose.text(rng, round(RULES_TOKENS * chars_per_token))
    listing = prose.text(rng, round(LISTING_TOKENS * chars_per_token))
    return classify_chat(listing, f"{_INSTRUCTIONS}\n{rules}", model)


def stream_chat() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Stream twenty tokens to the benchmark."}],
        "max_tokens": STREAM_TOKENS,
        "stream": True,
    }


def dumps(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"))


def classify_parts() -> tuple[str, list[str], str]:
    """The classification body split around the listing, each part already JSON-escaped."""
    body = dumps(classify_chat(_PLACEHOLDER))
    prefix, suffix = body.split(_PLACEHOLDER)
    return prefix, [json.dumps(x)[1:-1] for x in listings()], suffix
