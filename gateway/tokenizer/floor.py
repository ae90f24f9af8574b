"""A provable lower bound on a text's token count, at C speed, to refuse before tokenizing.

A tokenizer whose every input byte ends up in some token (byte-level BPE, or byte fallback: no
unknown token swallows a run of text, no normalizer or pre-tokenizer drops characters) cuts the
text into tokens of at most `L` bytes each, so a text of `B` UTF-8 bytes has at least `B / L`
tokens. Vocabularies hold long ASCII tokens (runs of `=`, code indentation) but only short ones
with non-ASCII bytes, so a second bound counts those alone: a text has at least `B - chars`
non-ASCII bytes (each non-ASCII character has two to four), and no token holds more than `L_hi`.
Whatever the tokenizer does beyond that (special tokens, a template around the text) only adds.
Both maxima come from the vocabulary, added tokens included, once at load; for any other kind of
tokenizer there is no floor and every text is counted.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Components that never drop or shrink what they see; a normalizer that does (NFKC, Lowercase,
# Strip, NFC's compositions) or a pre-tokenizer that drops whitespace leaves the tokenizer unbounded.
_SAFE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"})
_SAFE_NORMALIZERS = frozenset({"Prepend", "Replace"})


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, as `ByteLevel` writes tokens."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def flatten(component: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """A serialized tokenizer component as the list of what runs: a `Sequence`'s members
    (under `key`), nested ones too; the component alone otherwise; none for None."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [c for inner in component[key] for c in flatten(inner, key)]
    return [component]


def _safe(config: dict[str, Any]) -> tuple[bool, bool] | None:
    """(byte_level, byte_fallback) when the tokenizer covers every byte of its input, else None."""
    normalizers = flatten(config.get("normalizer"), "normalizers")
    for normalizer in normalizers:
        if normalizer.get("type") not in _SAFE_NORMALIZERS:
            return None
        if normalizer["type"] == "Replace":
            pattern = normalizer.get("pattern", {}).get("String")
            content = normalizer.get("content", "")
            if pattern is None or len(content.encode()) < len(pattern.encode()):
                return None
    pre = flatten(config.get("pre_tokenizer"), "pretokenizers")
    for component in pre:
        if component.get("type") not in _SAFE_PRE_TOKENIZERS:
            return None
        if str(component.get("behavior", "")).lower() == "removed":
            return None
    model = config.get("model", {})
    if model.get("type") not in ("BPE", "Unigram"):
        return None
    byte_level = any(c.get("type") == "ByteLevel" for c in pre)
    byte_fallback = bool(model.get("byte_fallback"))
    return (byte_level, byte_fallback) if byte_level or byte_fallback else None


def _config(backend: Any) -> dict[str, Any]:
    """What `_safe` and the added tokens' bound read of a tokenizer's serialized form, without
    serializing its vocabulary (tens of MB of JSON for a large one): each component's own
    state, the model's kind and byte fallback, the added tokens. A model other than BPE keeps
    its byte fallback in its state only, read whole then."""

    def state(component: Any) -> Any:
        return None if component is None else json.loads(component.__getstate__())

    model = backend.model
    kind = type(model).__name__
    if kind == "BPE":
        model_config = {"type": kind, "byte_fallback": model.byte_fallback}
    else:
        model_config = state(model)
    added = backend.get_added_tokens_decoder().values()
    return {
        "normalizer": state(backend.normalizer),
        "pre_tokenizer": state(backend.pre_tokenizer),
        "model": model_config,
        "added_tokens": [
            {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip} for t in added
        ],
    }


@dataclass(frozen=True, slots=True)
class TokenFloor:
    """At most `max_bytes` input bytes, and `max_high_bytes` non-ASCII ones, per token."""

    max_bytes: int
    max_high_bytes: int

    def tokens(self, text: str) -> int:
        """A count the tokenizer can never go under for `text`."""
        if text.isascii():  # a flag CPython keeps: no scan
            return math.ceil(len(text) / self.max_bytes)
        size = len(text.encode())
        floor = math.ceil(size / self.max_bytes)
        if self.max_high_bytes:
            floor = max(floor, math.ceil((size - len(text)) / self.max_high_bytes))
        return floor

    @classmethod
    def of(cls, backend: Any) -> TokenFloor | None:
        """The floor of a `tokenizers.Tokenizer`, or None when none is provable."""
        config = _config(backend)
        kind = _safe(config)
        if kind is None:
            return None
        byte_level, byte_fallback = kind
        vocab: dict[str, int] = backend.get_vocab(with_added_tokens=False)
        alphabet = _byte_level_alphabet()
        if byte_level and not all(char in vocab for char in alphabet):
            return None  # a byte with no token of its own would be dropped, or become <unk>
        if byte_fallback and not all(f"<0x{b:02X}>" in vocab for b in range(256)):
            return None
        # Each character of a byte-level token stands for one byte (one it does not know, for
        # 0xFF): deleting those standing for ASCII bytes leaves the non-ASCII ones. Per token,
        # at C speed: a vocabulary has hundreds of thousands.
        ascii_stand_ins = str.maketrans(dict.fromkeys(c for c, b in alphabet.items() if b < 0x80))
        max_bytes = max_high = 1
        for token in vocab:
            if (
                byte_fallback
                and token.startswith("<0x")
                and (match := _BYTE_TOKEN.fullmatch(token))
            ):
                size, high = 1, int(int(match.group(1), 16) >= 0x80)
            elif byte_level:
                size, high = len(token), len(token.translate(ascii_stand_ins))
            else:  # normalized text: as long as or longer than what it came from
                size = len(token.encode())
                high = size - len(token.encode("ascii", "ignore"))
            max_bytes, max_high = max(max_bytes, size), max(max_high, high)
        for added in config.get("added_tokens", []):  # matched on the raw text, before the model
            if added.get("lstrip") or added.get("rstrip"):
                return None  # it swallows any run of whitespace beside it
            content = added["content"].encode()
            max_bytes = max(max_bytes, len(content))
            max_high = max(max_high, sum(b >= 0x80 for b in content))
        return cls(max_bytes, max_high)
