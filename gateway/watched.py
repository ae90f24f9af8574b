"""Whether a watched file changed: the policy file and the listener's certificate pair, both
typically mounted from a Kubernetes volume that the kubelet updates by swapping its `..data`
symlink to a new directory (`policy.yaml -> ..data/policy.yaml`, `..data -> ..<timestamp>`).

A swap puts another file behind the same path. The path through the symlinks (the new
directory) and the inode tell it from the old one whatever its contents; the modification time
and size catch a file rewritten in place. Time and size alone miss a new file of the same size
written within one tick of the kernel's coarse file clock, or copied with its times kept.
"""

from __future__ import annotations

import os
from pathlib import Path

Stamp = tuple[str, int, int, int]


def stamp(path: str | Path) -> Stamp | None:
    """The file `path` resolves to and its inode, modification time and size; None while it
    does not resolve (a swap under way, a broken link, a symlink loop)."""
    try:
        real = os.path.realpath(path, strict=True)
        st = os.stat(real)
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop, on some Python versions
        return None
    return (real, st.st_ino, st.st_mtime_ns, st.st_size)
