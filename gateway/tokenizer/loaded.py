"""A tokenizer directory loaded once, whatever number of models name it and reloads keep it.

Loading is the gateway's start-up: transformers configures the tokenizer from its files (the
form vLLM encodes with), fastokens is built from that form and checked against it
(gateway/tokenizer/backends.py), and the chat template is examined. For Gemma 3 that is seconds
and hundreds of MB, so one load serves every model naming the same files: loads are kept by the
directory's resolved path, the counting backend asked for, and what identifies each file in it
(name, size, modification time, inode; kubelet's swap of a mounted ConfigMap changes them). A
reload whose directories did not change finds its tokenizers here; one whose files changed loads
anew. Entries live while a counter holds them, so a tokenizer no policy names is freed.

Where fastokens counts, the transformers tokenizer (with its own copy of the vocabulary in the
tokenizers library) is let go once loaded: rendering needs only its templates and special tokens
(`TemplateHost`), and fastokens decodes ids (`/detokenize`, `return_token_strs`) as transformers
does, checked as it loads (`decoding_disagreement`), so one engine stays resident. Where it does
not decode alike, the transformers tokenizer is kept for decoding. Nothing is loaded after the
policy: a lazy load on a tokenizer thread held the event loop for hundreds of milliseconds
(the tokenizers library builds its vocabulary holding the GIL), which the adversary found.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.tokenizer.backends import (
    Backend,
    Decoder,
    Encoder,
    FastokensEncoder,
    TransformersDecoder,
    choose,
    decoding_disagreement,
)
from gateway.tokenizer.chat_template import ChatTemplate, TemplateHost
from gateway.tokenizer.floor import TokenFloor
from gateway.watched import Stamp, stamp

log = logging.getLogger("gateway.tokenizer")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# The gateway spreads counting over its own threads (`server.tokenizer_threads`), one text
# each; the tokenizers library's own pool splitting a batch again adds its threads' wake-ups to
# every request's CPU.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TOKENIZER_FILE = "tokenizer.json"
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
# Files transformers may read besides tokenizer.json, in a subdirectory of the tokenizer's.
_NESTED = ("additional_chat_templates",)


def load_tokenizer(directory: str) -> Any:
    """Load a Hugging Face tokenizer from a local directory, never from the hub."""
    from transformers import AutoTokenizer

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"tokenizer directory {directory!r} does not exist")
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


@dataclass(frozen=True, slots=True)
class Identity:
    """What a load depends on: the resolved directory, each file's stat, the backend asked for."""

    directory: str
    files: tuple[tuple[str, Stamp | None], ...]
    backend: Backend

    @classmethod
    def of(cls, directory: str, backend: Backend) -> Identity:
        """Raise `FileNotFoundError` when `directory` is not one."""
        root = Path(directory).resolve()
        if not root.is_dir():
            raise FileNotFoundError(f"tokenizer directory {directory!r} does not exist")
        files = []
        for folder in (root, *(root / name for name in _NESTED)):
            if not folder.is_dir():
                continue
            for entry in os.scandir(folder):
                if entry.name.startswith("."):  # kubelet's `..data` and its timestamped copies
                    continue
                # through symlinks: a swapped ConfigMap shows as changed (gateway/watched.py)
                files.append((os.path.relpath(entry.path, root), stamp(entry.path)))
        return cls(str(root), tuple(sorted(files)), backend)


class LoadedTokenizer:
    """One tokenizer directory's counting parts: the encoder, the chat template, the floor."""

    def __init__(self, identity: Identity, tokenizer: Any, encoder: Encoder) -> None:
        self.identity = identity
        self.encoder = encoder
        host = TemplateHost.of(tokenizer)
        self.template = ChatTemplate(host)
        self.floor = TokenFloor.of(tokenizer.backend_tokenizer)
        self.specials = encoder.counts([""], True)[0]
        self.vocab_size = len(tokenizer)  # token ids, added tokens included
        # The transformers tokenizer stays only in what still needs it: the decoder where
        # fastokens does not decode alike, the template host where it renders itself.
        self.decoder: Decoder = TransformersDecoder(tokenizer)
        if isinstance(encoder, FastokensEncoder):
            different = decoding_disagreement(encoder, tokenizer)
            if different is None:
                self.decoder = encoder
            else:
                log.warning(
                    "%s: fastokens decodes %s differently; transformers decodes it (resident)",
                    identity.directory,
                    different,
                )

    @classmethod
    def load(cls, identity: Identity, model: str) -> LoadedTokenizer:
        tokenizer = load_tokenizer(identity.directory)
        encoder = choose(tokenizer, identity.backend, model or identity.directory)
        return cls(identity, tokenizer, encoder)

    @property
    def current(self) -> bool:
        """Whether the directory still holds the files this was loaded from."""
        try:
            return Identity.of(self.identity.directory, self.identity.backend) == self.identity
        except FileNotFoundError:
            return False


_loaded: weakref.WeakValueDictionary[Identity, LoadedTokenizer] = weakref.WeakValueDictionary()
_loading = threading.Lock()  # policies compile on threads (start, reload); tests call it anywhere


def shared(directory: str, backend: Backend, model: str = "") -> LoadedTokenizer:
    """The tokenizer in `directory` counted with `backend`, loaded now unless a counter holds
    it loaded from the same files; raise `FileNotFoundError` (no directory), `OSError` or
    `ValueError` (transformers cannot load it), `BackendError` (a forced fastokens cannot count
    it exactly)."""
    identity = Identity.of(directory, backend)
    with _loading:
        found = _loaded.get(identity)
        if found is None:
            found = _loaded[identity] = LoadedTokenizer.load(identity, model)
        return found


def return_freed_memory() -> None:
    """Give the C allocator's free pages back to the system (glibc's `malloc_trim`): loading
    leaves hundreds of MB free but held (the parsed tokenizer.json, the transformers tokenizer
    let go), which the process's RSS would otherwise count until reused. Nothing elsewhere."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def lacks(directory: Path, chat: str | None) -> str | None:
    """What `directory` lacks for counting, said, or None: `tokenizer.json` (what both encoders
    load), and, where `chat` says why one is needed, a default chat template: transformers' own
    file (chat_template.jinja, or the older chat_template.json) or tokenizer_config.json's
    `chat_template` (a text, or named ones among which `default`). Reads tokenizer_config.json
    at most: a check without the seconds and hundreds of MB a load costs."""
    where = f"tokenizer directory {str(directory)!r}"
    if not directory.is_dir():
        return f"{where} does not exist"
    if not (directory / TOKENIZER_FILE).is_file():
        return f"{where} holds no {TOKENIZER_FILE}"
    if not chat or any((directory / f).is_file() for f in _TEMPLATE_FILES):
        return None
    config_file = directory / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_bytes()) if config_file.is_file() else {}
    except (OSError, ValueError) as exc:  # unreadable, or not JSON
        return f"{where}: cannot read tokenizer_config.json: {exc}"
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        if any(isinstance(t, dict) and t.get("name") == "default" for t in template):
            return None
    elif isinstance(template, str) and template:
        return None
    return (
        f"{where} holds no chat template (chat_template.jinja, or tokenizer_config.json's),"
        f" and {chat}"
    )
