"""Exact token counts of long texts from cached counts of their prefixes.

Classification prompts repeat a long rules block and append a short unique part, often in the same
message, so a per-message memo misses. A count here is `count(prefix) + count(rest)`, the prefix's
count from a cache, and that sum is exactly the tokenizer's count: texts are cut only where the
tokenizer provably never lets a token, a pre-tokenizer piece or an added token cross. Where that
cannot be proven from the tokenizer's own serialized form, once at load, the mode is `OFF` and
every text is encoded whole.

Every cut is just after a newline, `text[i-1] == "\\n"`, and the rest is counted "in context":
`count(ANCHOR + rest) - count(ANCHOR)` with `ANCHOR = "\\n"`, so whatever the tokenizer does at
the start of a text (a prepended `▁` or space) happens to the anchor, never to the rest. Lemma,
for a text T cut at a safe i: the tokens of T are those of T[:i] followed by a sequence that
depends on T[i:] alone. Applied to T and to ANCHOR + T[i:] (also safe at its cut), it gives
`count(T) = count(T[:i]) + count(ANCHOR + T[i:]) - count(ANCHOR)`. Why the lemma holds:

- Common to both families: no added token contains a newline or strips whitespace beside it
  (`lstrip`/`rstrip`), so no added-token match crosses the cut, the matches left of it are those of
  T[:i] alone and those right of it depend on T[i:] alone (a `single_word` token at i sees the
  newline before it either way). Normalizers are only `Prepend` (at a split's start, and the cut is
  none: the newline is not an added token's end), `Replace` of strings without a newline (no match
  can cover the cut's newline), and NFC with Llama 3's rule (a newline is a stable code point:
  NFC(A + "\\n" + B) is NFC(A) + "\\n" + NFC(B); and NFC starts no non-whitespace character's
  text with whitespace, tested over all of Unicode). The post-processor adds the same special
  tokens to any single text (BOS once, at the start), so a count with special tokens is the count
  without them plus that constant.
- `PRE_TOKENIZER_SPLIT` (byte-level BPE whose pieces come from GPT-2's or Llama 3's / Qwen 2's split
  regex, no prefix space): BPE never merges across pieces, so the count is additive if the pieces
  are, and the regexes have no lookbehind, so the pieces right of a piece boundary depend on the
  text right of it. With Llama 3's regex, i is a boundary whenever T[i] is not whitespace: every
  alternative that can take a newline continues after it only with `[\\r\\n]` or `\\s`, and the one
  test that would read T[i] differently from end-of-text, `\\s+(?!\\S)`, is never reached from
  inside a whitespace run that ends in a newline (`\\s*[\\r\\n]+`, earlier, always matches there).
  GPT-2's regex has no `\\s*[\\r\\n]+`: its `\\s+(?!\\S)` splits a run "  \\n" before a word into
  "  " + "\\n" but takes it whole at end-of-text, so it also needs T[i-2] not whitespace: the run
  is the lone newline, a piece either way.
- `NO_MERGE` (SentencePiece-style BPE: no pre-tokenizer, or one that splits only at matches of a
  string without a newline, Metaspace's `▁` or Gemma's Split: no match spans the cut, and those on
  each side are that side's alone, so the pieces are those of the two sides): BPE runs over words
  that may span the cut, so the vocabulary must forbid crossing: no token has a newline followed by
  anything but a newline, the newline is a token of its own (or a byte-fallback byte no token
  starts with), and a cut is a newline followed by anything but a newline. No merge can then join
  the symbol left of the cut (it ends in a newline) with the one right of it, and as merges only
  join neighbours, each side merges exactly as it would alone (the best-ranked pair on one side is
  still the best-ranked on that side whatever the other side does).

Cuts are the first safe position at or after each multiple of `block_chars`: they depend only on
the text up to them, so two prompts that share a rules block share its cuts and the cache keys at
them (the BLAKE2b digest of the prefix's UTF-8; 128 bits, collisions not a practical concern).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from gateway.tokenfloor import flatten

PRE_TOKENIZER_SPLIT = "pre-tokenizer split"
NO_MERGE = "no-merge boundary"
OFF = "off"
ANCHOR = "\n"
_BYTE_NEWLINE = "<0x0A>"

# The split patterns the argument above covers, exactly as tokenizer.json writes them.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")

# Cut positions per rule (Python's `\s` is `str.isspace`, a superset of the regexes' `\s`).
_AFTER_NEWLINE = re.compile(r"(?<=\n)(?=\S)")
_AFTER_LONE_NEWLINE = re.compile(r"(?<=\S\n)(?=\S)")
_AFTER_NEWLINE_RUN = re.compile(r"(?<=\n)(?=[^\n])")


@dataclass(frozen=True, slots=True)
class Plan:
    """How a tokenizer's texts may be cut: `mode` names the argument, `cuts` finds positions."""

    mode: str
    cuts: re.Pattern[str] | None


_OFF = Plan(OFF, None)


def _normalizers_concatenate(config: dict[str, Any], allowed: frozenset[str]) -> bool:
    for normalizer in flatten(config.get("normalizer"), "normalizers"):
        kind = normalizer.get("type")
        if kind not in allowed:
            return False
        if kind == "Replace":
            pattern = normalizer.get("pattern", {}).get("String")
            if pattern is None or "\n" in pattern or "\n" in normalizer.get("content", "\n"):
                return False
        if kind == "Prepend" and "\n" in normalizer.get("prepend", "\n"):
            return False
    return True


def _added_tokens_stay_apart(config: dict[str, Any]) -> bool:
    return all(
        "\n" not in added["content"] and not added.get("lstrip") and not added.get("rstrip")
        for added in config.get("added_tokens", [])
    )


def _split_rule(pre: list[dict[str, Any]]) -> re.Pattern[str] | None:
    """The cut rule of a byte-level split pre-tokenizer the argument covers, else None."""
    if len(pre) == 1 and pre[0].get("type") == "ByteLevel":
        byte_level, pattern = pre[0], GPT2_PATTERN if pre[0].get("use_regex", True) else None
    elif len(pre) == 2 and [c.get("type") for c in pre] == ["Split", "ByteLevel"]:
        split, byte_level = pre
        if (
            split.get("behavior") != "Isolated"
            or split.get("invert")
            or byte_level.get("use_regex")
        ):
            return None
        pattern = split.get("pattern", {}).get("Regex")
    else:
        return None
    if byte_level.get("add_prefix_space"):
        return None
    if pattern == GPT2_PATTERN:
        return _AFTER_LONE_NEWLINE
    if pattern in (LLAMA3_PATTERN, QWEN2_PATTERN):
        return _AFTER_NEWLINE
    return None


def _newline_never_merges(model: dict[str, Any]) -> bool:
    """No token holds a newline followed by another character, and the newline is a symbol of
    its own: a token, or a byte-fallback byte no other token starts with."""
    vocab: dict[str, int] = model.get("vocab", {})
    for token in vocab:
        at = token.find("\n")
        while at != -1:
            if at + 1 < len(token) and token[at + 1] != "\n":
                return False
            at = token.find("\n", at + 1)
    if "\n" in vocab:
        return True
    return (
        bool(model.get("byte_fallback"))
        and _BYTE_NEWLINE in vocab
        and not any(t.startswith(_BYTE_NEWLINE) and t != _BYTE_NEWLINE for t in vocab)
    )


def _splits_in_place(component: dict[str, Any]) -> bool:
    """A pre-tokenizer whose splits are fixed positions no cut's newline is part of: Metaspace's
    at each `▁`, or a Split at each match of a string without a newline (Gemma's)."""
    if component.get("type") == "Metaspace":
        return True
    pattern = component.get("pattern", {}).get("String")
    return (
        component.get("type") == "Split"
        and isinstance(pattern, str)
        and "\n" not in pattern
        and not component.get("invert")
        and component.get("behavior") != "Removed"
    )


def plan(backend: Any, config: dict[str, Any] | None = None) -> Plan:
    """Whether, and by which argument, cut counts of this `tokenizers.Tokenizer` are exact;
    `config` is its serialized form when the caller parsed it already."""
    config = json.loads(backend.to_str()) if config is None else config
    model = config.get("model", {})
    if (
        model.get("type") != "BPE"
        or model.get("dropout")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
        or not _added_tokens_stay_apart(config)
    ):
        return _OFF
    pre = flatten(config.get("pre_tokenizer"), "pretokenizers")
    split = _split_rule(pre)
    if split is not None:
        # NFC only with Llama 3's rule (Qwen 2 has it): GPT-2's also reads the char before.
        nfc = frozenset({"NFC"}) if split is _AFTER_NEWLINE else frozenset()
        ok = _normalizers_concatenate(config, nfc)
        return Plan(PRE_TOKENIZER_SPLIT, split) if ok else _OFF
    if len(pre) <= 1 and all(map(_splits_in_place, pre)):
        if _normalizers_concatenate(
            config, frozenset({"Prepend", "Replace", "NFC"})
        ) and _newline_never_merges(model):
            return Plan(NO_MERGE, _AFTER_NEWLINE_RUN)
    return _OFF


@dataclass(slots=True)
class _Job:
    """One text's share of a batch: `pieces` from `at`, all behind the anchor but a first that
    starts the text (`bare`), on top of a cached `base`; `keys`, the prefixes they complete."""

    at: int
    pieces: list[str]
    bare: bool
    base: int
    keys: list[bytes]


class PrefixCounts:
    """Token counts of texts (`lengths`), long ones from the longest cached prefix and the rest.

    Thread-safe: counting runs on the tokenizer's threads; the cache is guarded by a lock that is
    never held while encoding. `block_chars` spaces the cuts; texts longer than `max_chars` are
    encoded whole, so the Python-level work (finding cuts, hashing) stays bounded per text.
    `entries=0` caches nothing: each text with cuts is still cut, and is a miss.

    Lookups are counted, under the lock, for `/metrics`: a text with at least one cut is a `hit`
    when a cached prefix of it was used, a `miss` when none was cached; `held` is the entries
    now cached. Plain ints, read without the lock (each read is one attribute or `len`).
    """

    def __init__(
        self,
        backend: Any,
        *,
        entries: int,
        block_chars: int = 1024,
        max_chars: int = 1 << 18,
        config: dict[str, Any] | None = None,
    ) -> None:
        self._plan = plan(backend, config)
        self.mode = self._plan.mode
        self._encode: Callable[..., Any] = getattr(
            backend, "encode_batch_fast", backend.encode_batch
        )
        processor = backend.post_processor
        self._special = 0 if processor is None else processor.num_special_tokens_to_add(False)
        self._anchor = len(self._encode([ANCHOR], add_special_tokens=False)[0])
        self.entries = entries
        self.block_chars = block_chars
        self.max_chars = max_chars
        self._cache: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def held(self) -> int:
        """Prefix counts cached now, at most `entries`."""
        return len(self._cache)

    def _cuts(self, text: str) -> list[int]:
        """The first safe cut at or after each multiple of `block_chars`, deduplicated."""
        pattern = self._plan.cuts
        if pattern is None or len(text) > self.max_chars:
            return []
        cuts: list[int] = []
        at = self.block_chars
        while at < len(text):
            found = pattern.search(text, at)
            if found is None:
                break
            cuts.append(found.start())
            at = (found.start() // self.block_chars + 1) * self.block_chars
        return cuts

    def lengths(self, texts: list[str], special: bool) -> list[int]:
        """Each text's token count, as `encode_batch(texts, add_special_tokens=special)` gives.

        All the encoding is one batch call, which releases the GIL (`encode` holds it)."""
        jobs: list[_Job] = []
        batch: list[str] = []
        for text in texts:
            job = self._job(text, len(batch))
            jobs.append(job)
            batch.extend(job.pieces)
        # len(encoding) counts its ids without building a list of them (under the GIL)
        counts = [len(e) for e in self._encode(batch, add_special_tokens=False)]
        out = []
        for job in jobs:
            total, fresh = job.base, []
            for n in range(len(job.pieces)):
                anchored = n or not job.bare
                total += counts[job.at + n] - (self._anchor if anchored else 0)
                if n < len(job.keys):
                    fresh.append((job.keys[n], total))
            self._remember(fresh)
            out.append(total + (self._special if special else 0))
        return out

    def _job(self, text: str, at: int) -> _Job:
        """What to encode for `text`: the pieces after its longest cached prefix, each but a
        text's first piece behind the anchor."""
        cuts = self._cuts(text)
        if not cuts:
            return _Job(at, [text], True, 0, [])
        keys = _prefix_keys(text, cuts)
        base, covered = self._longest(keys)
        bounds = [cuts[covered - 1] if covered else 0, *cuts[covered:], len(text)]
        pieces = [text[a:b] for a, b in pairwise(bounds)]
        bare = not covered
        pieces = [p if bare and not n else ANCHOR + p for n, p in enumerate(pieces)]
        return _Job(at, pieces, bare, base, keys[covered:])

    def _longest(self, keys: list[bytes]) -> tuple[int, int]:
        """(count, how many cuts it covers) of the longest cached prefix, or (0, 0)."""
        with self._lock:
            for n in range(len(keys), 0, -1):
                count = self._cache.get(keys[n - 1])
                if count is not None:
                    self._cache.move_to_end(keys[n - 1])
                    self.hits += 1
                    return count, n
            self.misses += 1
        return 0, 0

    def _remember(self, fresh: list[tuple[bytes, int]]) -> None:
        if not fresh or not self.entries:
            return
        with self._lock:
            for key, count in fresh:
                self._cache[key] = count
            while len(self._cache) > self.entries:
                self._cache.popitem(last=False)


def _prefix_keys(text: str, cuts: list[int]) -> list[bytes]:
    """The BLAKE2b digest of each `text[:cut]`'s UTF-8, in one pass over the text."""
    digest = hashlib.blake2b(digest_size=16)
    keys, start = [], 0
    for cut in cuts:
        digest.update(text[start:cut].encode("utf-8", "surrogatepass"))
        keys.append(digest.copy().digest())
        start = cut
    return keys
