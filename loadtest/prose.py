"""Real English prose for benchmarks and tests: the paragraphs of Python's own stdlib docstrings.

A tokenizer's cost depends on what it reads. A small vocabulary of words or pseudo-words, repeated,
stays in the tokenizers library's word cache and in any count cache, and flatters both; people's
prompts are prose, with prose's long tail of rare words, names and punctuation. The standard
library's docstrings are real English prose written by many people, present wherever Python is,
and nothing has to be downloaded or committed. The corpus is fixed for a given Python (the same
modules, members and paragraphs, in order; a module whose members appear lazily, such as
`concurrent.futures`, adds those another import already loaded); only the draws are random, so a
seed from the OS makes every run's texts new while `random.Random(n)` repeats one.

    text(rng, chars)   # random paragraphs, joined by blank lines, until about `chars` characters
    paragraphs()       # the whole corpus (a tuple, built once)
"""

from __future__ import annotations

import functools
import importlib
import inspect
import random
import re
import warnings

# Modules with much documented API; those missing from a Python build are skipped.
MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bdb", "binascii", "bisect",
    "builtins", "bz2", "calendar", "cmd", "codecs", "collections", "colorsys", "concurrent.futures",
    "configparser", "contextlib", "copy", "csv", "ctypes", "dataclasses", "datetime", "decimal",
    "difflib", "dis", "doctest", "email", "enum", "filecmp", "fileinput", "fnmatch", "fractions",
    "ftplib", "functools", "gc", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac",
    "html", "http.client", "http.cookiejar", "http.server", "imaplib", "importlib", "inspect",
    "io", "ipaddress", "itertools", "json", "locale", "logging", "lzma", "mailbox", "math",
    "mimetypes", "multiprocessing", "netrc", "operator", "optparse", "os", "pathlib", "pdb",
    "pickle", "pickletools", "platform", "plistlib", "poplib", "pprint", "pydoc", "queue",
    "random", "re", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "signal",
    "smtplib", "socket", "socketserver", "sqlite3", "ssl", "statistics", "string", "struct",
    "subprocess", "sys", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
    "trace", "traceback", "turtle", "typing", "unittest", "urllib.parse", "urllib.request",
    "uuid", "warnings", "wave", "weakref", "xml.dom.minidom", "xml.etree.ElementTree",
    "zipfile", "zoneinfo",
)  # fmt: skip
MIN_CHARS = 80  # shorter paragraphs are mostly signatures and headings
MIN_LETTERS = 0.85  # letters and spaces, of a paragraph's characters: prose, not code or tables
_SPACE = re.compile(r"\s+")


def _docstrings(module: object) -> list[str]:
    """The module's own docstring and its public members' (a class's methods too)."""
    found = [inspect.getdoc(module) or ""]
    for name, member in sorted(vars(module).items()):
        if name.startswith("_"):
            continue
        if callable(member):
            found.append(inspect.getdoc(member) or "")
        if inspect.isclass(member):
            found += [
                inspect.getdoc(attr) or ""
                for attr_name, attr in sorted(vars(member).items())
                if not attr_name.startswith("_") and callable(attr)
            ]
    return found


def _prose(paragraph: str) -> bool:
    letters = sum(c.isalpha() or c == " " for c in paragraph)
    return len(paragraph) > MIN_CHARS and letters >= MIN_LETTERS * len(paragraph)


@functools.cache
def paragraphs() -> tuple[str, ...]:
    """Every prose-like paragraph of the modules' docstrings, whitespace-normalized, each once,
    in a fixed order."""
    seen: dict[str, None] = {}
    with warnings.catch_warnings():  # some modules warn of their own deprecation on import
        warnings.simplefilter("ignore")
        for name in MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for doc in _docstrings(module):
                for block in doc.split("\n\n"):
                    paragraph = _SPACE.sub(" ", block).strip()
                    if _prose(paragraph):
                        seen.setdefault(paragraph)
    return tuple(seen)


def text(rng: random.Random, chars: int) -> str:
    """Paragraphs drawn at random (with replacement) from the corpus, joined by blank lines, until
    the text has at least `chars` characters (it overshoots by less than one paragraph)."""
    corpus = paragraphs()
    drawn: list[str] = []
    size = 0
    while size < chars:
        drawn.append(rng.choice(corpus))
        size += len(drawn[-1]) + 2
    return "\n\n".join(drawn)
