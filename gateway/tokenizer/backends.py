"""Which library turns a model's text into token ids: fastokens where it is proven to agree with
the tokenizers library on that model's tokenizer, else the tokenizers library itself.

Counting is the gateway's dominant CPU cost. The tokenizers library (what transformers, and so
vLLM, encodes with) is the reference; fastokens (Rust, Apache-2.0, loads the same `tokenizer.json`;
vLLM ships it as a tokenizer mode) encodes the same ids at a fraction of the CPU; on a thread it lets the
event loop run while it encodes, though two threads encode no faster than one. It is only trusted per tokenizer, after a self-check at load: every added token
(alone, between words, doubled, with and without special tokens), long runs of every kind of
whitespace, digits and punctuation, and text in many scripts with emoji, combining marks and
control characters are encoded by both, and every id must match. fastokens is built from the
tokenizer as transformers configured it (`backend_tokenizer`), so a post-processor or added token
that transformers set from `tokenizer_config.json` is in both. A disagreement keeps the tokenizers
library (`auto`) or refuses the policy (`fastokens`, forced): a forced backend that counts wrong
would be worse than a slow one.

Both encoders turn off a tokenizer.json's truncation and padding: vLLM counts through
transformers, whose calls set both off unless a prompt is to be truncated.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol

log = logging.getLogger("gateway.tokenizer.backends")

Backend = Literal["auto", "fastokens", "tokenizers"]
FASTOKENS: Backend = "fastokens"
TOKENIZERS: Backend = "tokenizers"
AUTO: Backend = "auto"


class Encoder(Protocol):
    """Encodes texts for one model; thread-safe (counting runs on the tokenizer threads)."""

    name: str
    inline_share: int
    """`server.inline_tokenize_max_chars` is divided by this for the texts it counts inline: the
    CPU per character against fastokens', so a text holds the loop no longer whichever counts."""

    def counts(self, texts: list[str], special: bool) -> list[int]:
        """Each text's token count, with the post-processor's special tokens when `special`."""
        ...

    def batch_ids(self, texts: list[str], special: bool) -> list[list[int]]:
        """Each text's token ids."""
        ...


class Decoder(Protocol):
    """Token ids back to text, as transformers' `decode` and `convert_ids_to_tokens` give them
    (vLLM's `/detokenize` and `return_token_strs`); thread-safe."""

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens kept."""
        ...

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's token string."""
        ...


class TransformersDecoder:
    """transformers' own decoding: the reference, for a tokenizer fastokens does not decode
    alike (it keeps the transformers tokenizer resident)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids))

    def token_strs(self, ids: list[int]) -> list[str]:
        return list(self._tokenizer.convert_ids_to_tokens(ids))


class TokenizersEncoder:
    """The tokenizers library, as transformers configured it: the reference.

    The batch entry point releases the GIL (the single-text `encode` holds it), and
    `len(encoding)` counts ids without building a list of them under the GIL.
    """

    name: str = TOKENIZERS
    inline_share = 8  # several times fastokens' CPU per character, tens on whitespace runs

    def __init__(self, backend: Any) -> None:
        backend.no_truncation()
        backend.no_padding()
        self._encode: Callable[..., Any] = getattr(
            backend, "encode_batch_fast", backend.encode_batch
        )

    def counts(self, texts: list[str], special: bool) -> list[int]:
        return [len(e) for e in self._encode(texts, add_special_tokens=special)]

    def batch_ids(self, texts: list[str], special: bool) -> list[list[int]]:
        return [list(e.ids) for e in self._encode(texts, add_special_tokens=special)]


class FastokensEncoder:
    """fastokens, built from the reference's own serialized form."""

    name: str = FASTOKENS
    inline_share = 1

    def __init__(self, serialized: str) -> None:
        import fastokens

        self._tokenizer = fastokens.Tokenizer.from_json_str(serialized)
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()

    def counts(self, texts: list[str], special: bool) -> list[int]:
        encode = self._tokenizer.encode
        return [len(encode(text, add_special_tokens=special)) for text in texts]

    def batch_ids(self, texts: list[str], special: bool) -> list[list[int]]:
        encoded = self._tokenizer.encode_batch(texts, add_special_tokens=special)
        return [list(e.ids) for e in encoded]

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=False))

    def token_strs(self, ids: list[int]) -> list[str]:
        id_to_token = self._tokenizer.id_to_token
        return [id_to_token(i) for i in ids]


def ids(encoder: Encoder, text: str, special: bool) -> list[int]:
    """The token ids of one text."""
    return encoder.batch_ids([text], special)[0]


_WHITESPACE = (" ", "\n", "\t", "\r\n", " \n", "\n ", "\u00a0", "\u3000", "\u2009", "\x0b", "\x0c")
_RUNS = (1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 64, 65, 127, 128, 255, 256, 1000)
_SCRIPTS = (
    "Hello, world! It's 2026; don't panic: e=mc^2 (approx.) -- ok?",
    "caf\u00e9 cafe\u0301 na\u00efve \u00c5ngstr\u00f6m \u0130stanbul stra\u00dfe \ufb01ne",
    "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac \u0440\u0443\u0441\u0441\u043a\u0438\u0439 "
    "\u05e2\u05d1\u05e8\u05d9\u05ea \u0627\u0644\u0639\u0631\u0628\u064a\u0629 "
    "\u0939\u093f\u0928\u094d\u0926\u0940 \u0e44\u0e17\u0e22",
    "\u4e2d\u6587\u5b57\u7b26 \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 "
    "\ud55c\uad6d\uc5b4 \u1100\u1161\u11a8",
    "\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1eb\U0001f1f7 "
    "\u2764\ufe0f \U0001f9d1\U0001f3ff\u200d\U0001f4bb",
    "a\u0301\u0302\u0303\u0304 \u200b\u200c\u200d\ufeff \x00\x01\x1f\x7f \ue000\U0010fffd",
    "def f(x):\n\treturn {'k': [1, 2, 3]}  # code\n\n\n    if x >= 10_000: pass\r\n",
    "0123456789 3.14159 1,000,000 -42 0xFF 1e-9 \u0661\u0662\u0663 \uff11\uff12",
    "!!!??? ... --- ___ *** ### /// \\\\\\ ``` ''' \"\"\" <<>> [[]] {{}} ~~~ ^^^ |||",
)

# What warms an encoder on a thread (`HFCounter.warm`): text in many scripts, so that the paths a
# request may take are built before one does.
WARM_TEXT = " ".join(_SCRIPTS) * 8


def _probes(added: list[str]) -> Iterator[str]:
    """Texts on which two encoders of one tokenizer must agree: every added token in every
    position, whitespace runs of every kind and length, and text in many scripts."""
    yield ""
    yield from _SCRIPTS
    yield " ".join(_SCRIPTS)
    for char in _WHITESPACE:
        for run in _RUNS:
            yield char * run
            yield f"word{char * run}word"
            yield f"{char * run}word{char * run}"
    for digits in ("7", "12", "123", "1234"):
        yield digits * 50
    for token in added:
        yield token
        yield token + token
        yield f"a{token}b"
        yield f" {token} "
        yield f"\n{token}\n{token}word"
        yield f"{_SCRIPTS[0]}{token}{_SCRIPTS[4]}"


def disagreement(fast: Encoder, reference: Encoder, added: list[str]) -> str | None:
    """The first probe on which `fast` and `reference` encode different ids, described, or None."""
    texts = list(_probes(added))
    for special in (False, True):
        pairs = zip(
            fast.batch_ids(texts, special), reference.batch_ids(texts, special), texts, strict=True
        )
        for got, want, text in pairs:
            if got != want:
                shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
                return f"{shown!r} (add_special_tokens={special})"
    return None


class BackendError(ValueError):
    """`tokenizer_backend: fastokens` was asked for, and it cannot count this tokenizer exactly."""


def decoding_disagreement(fast: FastokensEncoder, tokenizer: Any) -> str | None:
    """How fastokens decodes differently from transformers' `tokenizer`, or None: every added
    token alone and all together, then seeded runs of ids across the whole vocabulary (partial
    UTF-8 byte tokens among them), both as text and as token strings. transformers may also
    clean spaces up after decoding; a tokenizer that asks for it shows here as a difference."""
    added = sorted(tokenizer.backend_tokenizer.get_added_tokens_decoder())
    rng = random.Random(0)
    size = len(tokenizer)
    runs = [[i] for i in added] + [added]
    runs += [[rng.randrange(size) for _ in range(rng.randint(1, 64))] for _ in range(256)]
    for run in runs:
        try:
            if fast.decode(run) != tokenizer.decode(run):
                return f"the text of ids {run[:8]}"
            if fast.token_strs(run) != tokenizer.convert_ids_to_tokens(run):
                return f"the token strings of ids {run[:8]}"
        except Exception as exc:  # fastokens cannot decode it: transformers does
            return f"ids {run[:8]} ({exc!r})"
    return None


def choose(tokenizer: Any, wanted: Backend, model: str) -> Encoder:
    """The encoder for a transformers `tokenizer`: fastokens when wanted (or `auto`) and it
    agrees with the tokenizers library on every probe, else the tokenizers library. Raise
    `BackendError` when fastokens is forced and cannot be used."""
    reference = TokenizersEncoder(tokenizer.backend_tokenizer)
    if wanted == TOKENIZERS:
        return reference
    backend = tokenizer.backend_tokenizer
    try:
        fast: Encoder = FastokensEncoder(backend.to_str())
    except Exception as exc:  # an unsupported model or component: fastokens says which
        problem = f"fastokens cannot load it: {exc}"
    else:
        added = [token.content for token in backend.get_added_tokens_decoder().values()]
        found = disagreement(fast, reference, added)
        if found is None:
            return fast
        problem = f"fastokens and the tokenizers library encode {found} differently"
    if wanted == FASTOKENS:
        raise BackendError(f"{problem}; use tokenizer_backend: auto or tokenizers")
    log.warning("model %s is counted by the tokenizers library: %s", model, problem)
    return reference
