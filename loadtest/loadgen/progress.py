"""Progress on stderr: a live bar on a terminal, otherwise one line per level.

CI logs are not terminals, so there they get the per-level summary line and nothing else.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR = 24
REFRESH_S = 0.2


class Progress:
    def __init__(self, stream: TextIO | None = None, live: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.label = ""
        self.total = self.done = self.failed = 0
        self._started = self._drawn = 0.0

    def start(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.failed = label, total, 0, 0
        self._started = time.perf_counter()
        self._draw()

    def tick(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if self.live and time.perf_counter() - self._drawn >= REFRESH_S:
            self._draw()

    def _draw(self) -> None:
        if not self.live:
            return
        self._drawn = time.perf_counter()
        filled = BAR * self.done // max(1, self.total)
        elapsed = self._drawn - self._started
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (BAR - filled)}] {self.done}/{self.total}"
            f" failed {self.failed} {elapsed:5.1f}s"
        )
        self.stream.flush()

    def finish(self, summary: str) -> None:
        self.stream.write(("\r\x1b[2K" if self.live else "") + f"{self.label}: {summary}\n")
        self.stream.flush()
