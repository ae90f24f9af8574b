"""Request bodies whose prompts are exactly the planned number of tokens for the target model.

The count is the one the server will make: a chat prompt is the model's chat template rendered
with `add_generation_prompt=True` and encoded without extra special tokens; a completions prompt
is encoded with them (vLLM does both, and so does the gateway's `gateway/tokens.py`). Without a
tokenizer the prompt is 4 characters a token, and only the server's usage chunk tells the truth.

How a prompt of N tokens is made, cheaply: a long filler text of common words is encoded once,
keeping where each of its tokens ends. A prompt is a unique tag (so that no two requests share a
prefix the server could cache: a second request for a prompt would skip its prefill) followed by
the filler cut at a token end. The cut is guessed, the whole templated prompt is counted, and the
cut moves by the difference until the count is exact; when two cuts straddle the target (a merge
at the cut), the filler starts one token later and the search goes on. The guess per (endpoint,
ISL) is remembered, so after the first request of a shape one batched encode verifies each prompt.
All of it runs before a level's clock starts, in `tokenizers`' batch encoder (which releases the
GIL), so the generator is never the bottleneck of the measurement.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from gateway.tokens import load_tokenizer
from loadtest.loadgen.workloads import Endpoint, Planned
from loadtest.tiny_tokenizer import WORDS

CHARS_PER_TOKEN = 4.0
MAX_ROUNDS = 24


def filler(words: int, seed: int = 11) -> str:
    """Deterministic prose-like text: the tokenizer sees ordinary words, not one repeated token."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass(slots=True)
class _Search:
    """One prompt being fitted: the filler span [start, start + k) tokens after the tag."""

    endpoint: Endpoint
    target: int
    tag: str
    start: int
    k: int
    tried: set[int]


class PromptBuilder:
    """Makes OpenAI request bodies for planned requests; one builder serves a whole run."""

    def __init__(self, tokenizer_dir: str | Path | None = None) -> None:
        self.tokenizer = None if tokenizer_dir is None else load_tokenizer(str(tokenizer_dir))
        self._serial = itertools.count()
        self._text = ""
        self._ends: list[int] = []  # character offset where each filler token ends
        # Tokens besides the filler (template, tag) that made an exact prompt last time.
        self._by_shape: dict[tuple[Endpoint, int], int] = {}
        self._by_endpoint: dict[Endpoint, int] = {}

    def count(self, endpoint: Endpoint, texts: Sequence[str]) -> list[int]:
        """Input tokens the server will count for each prompt text."""
        assert self.tokenizer is not None
        if endpoint == "chat":
            rendered = [
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
                )
                for t in texts
            ]
            return self._lengths(rendered, special=False)
        return self._lengths(list(texts), special=True)

    def _lengths(self, texts: list[str], special: bool) -> list[int]:
        assert self.tokenizer is not None
        backend = self.tokenizer.backend_tokenizer
        encoded = backend.encode_batch(texts, add_special_tokens=special)
        return [len(e.ids) for e in encoded]

    def texts(self, shapes: Sequence[tuple[Endpoint, int]]) -> list[str]:
        """A unique prompt text of exactly `isl` tokens for each (endpoint, isl)."""
        tags = [f"{next(self._serial)}." for _ in shapes]  # short: a few tokens in any vocabulary
        if self.tokenizer is None:
            return [self._by_chars(tag, isl) for tag, (_, isl) in zip(tags, shapes, strict=True)]
        searches = {
            i: _Search(endpoint, isl, tag, 0, max(0, isl - self._guess(endpoint, isl)), set())
            for i, (tag, (endpoint, isl)) in enumerate(zip(tags, shapes, strict=True))
        }
        done: dict[int, str] = {}
        for _ in range(MAX_ROUNDS):
            for endpoint in ("chat", "completions"):
                batch = [(i, s) for i, s in searches.items() if s.endpoint == endpoint]
                if not batch:
                    continue
                candidates = [self._candidate(s) for _, s in batch]
                counts = self.count(endpoint, candidates)
                for (i, s), text, got in zip(batch, candidates, counts, strict=True):
                    if got == s.target:
                        done[i] = text
                        self._by_shape[(endpoint, s.target)] = self._by_endpoint[endpoint] = (
                            s.target - s.k
                        )
                        del searches[i]
                    else:
                        self._step(s, s.target - got)
            if not searches:
                return [done[i] for i in range(len(shapes))]
        s = next(iter(searches.values()))
        raise RuntimeError(f"could not build a {s.endpoint} prompt of exactly {s.target} tokens")

    def _guess(self, endpoint: Endpoint, isl: int) -> int:
        """This shape's last overhead, else the endpoint's last, else none (the first prompt)."""
        return self._by_shape.get((endpoint, isl), self._by_endpoint.get(endpoint, 0))

    def _step(self, s: _Search, diff: int) -> None:
        s.tried.add(s.k)
        s.k = max(0, s.k + diff)
        if s.k in s.tried:
            if s.k == 0 and diff < 0:
                raise ValueError(
                    f"{s.target} input tokens is less than the {s.endpoint} prompt's own overhead"
                    " (template and request tag)"
                )
            s.start += 1  # the two cuts around the target straddle a merge: shift the filler
            s.tried.clear()

    def _candidate(self, s: _Search) -> str:
        while len(self._ends) < s.start + s.k:
            self._grow()
        begin = self._ends[s.start - 1] if s.start else 0
        end = self._ends[s.start + s.k - 1] if s.k else begin
        return f"{s.tag} {self._text[begin:end].lstrip()}"

    def _grow(self) -> None:
        """Double the filler; with a tokenizer, encode it once to learn its token ends."""
        self._text = filler(max(4096, 2 * self._text.count(" ")))
        if self.tokenizer is not None:
            encoded = self.tokenizer.backend_tokenizer.encode(self._text, add_special_tokens=False)
            self._ends = [end for _, end in encoded.offsets]

    def _by_chars(self, tag: str, isl: int) -> str:
        chars = round(isl * CHARS_PER_TOKEN)
        while len(self._text) < chars:
            self._grow()
        return f"{tag} {self._text}"[:chars]

    def bodies(self, model: str, planned: Sequence[Planned], stream: bool) -> list[bytes]:
        """Serialised request bodies, output fixed by `max_tokens` + `ignore_eos`."""
        texts = self.texts([(p.endpoint, p.isl) for p in planned])
        return [
            orjson.dumps(body(model, p, t, stream)) for p, t in zip(planned, texts, strict=True)
        ]


def body(model: str, planned: Planned, text: str, stream: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model}
    if planned.endpoint == "chat":
        out["messages"] = [{"role": "user", "content": text}]
    else:
        out["prompt"] = text
    # ignore_eos makes the output exactly max_tokens long: the shape is the load test's, not the model's.
    out |= {"max_tokens": planned.osl, "ignore_eos": True, "stream": stream}
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out
