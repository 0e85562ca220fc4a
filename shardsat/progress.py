"""A progress line for searches that take a while: saturation iterations and e-nodes, then
extraction. Silent for the first `after_s` seconds, so quick plans print nothing; uses rich when
it is installed and stderr is a terminal, a plain rewritten line otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    def __init__(self, enabled: bool | None = None, after_s: float = 2.0, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.after_s = after_s
        self.start = time.perf_counter()
        self.shown = False
        self._live: Any = None
        self.lines: list[str] = []

    def update(self, stage: str, detail: str = "") -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        if elapsed < self.after_s:
            return
        text = f"shardsat: {stage} {detail} [{elapsed:.1f}s]".rstrip()
        self.lines.append(text)
        if self._live is None and self.stream.isatty():
            try:
                from rich.console import Console
                from rich.live import Live

                self._live = Live(console=Console(file=self.stream), transient=True)
                self._live.start()
            except ImportError:
                self._live = False
        if self._live:
            self._live.update(text)
        elif self.stream.isatty():
            self.stream.write("\r" + text + "\x1b[K")
            self.stream.flush()
        else:
            self.stream.write(text + "\n")
        self.shown = True

    def close(self) -> None:
        if self._live:
            self._live.stop()
        elif self.shown and self.stream.isatty():
            self.stream.write("\r\x1b[K")
            self.stream.flush()
