"""A progress line for long operations: a bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

MIB = 1024 * 1024


class MigrationProgress:
    """Renders libvirt job statistics (memory_processed/remaining, iteration)."""

    def __init__(self, label: str, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.label = label
        self.stream = stream
        self.width = width
        self.tty = stream.isatty()
        self.start = time.monotonic()
        self.last_line = 0.0

    def __call__(self, stats: dict[str, int]) -> None:
        total = stats.get("memory_total", 0)
        remaining = stats.get("memory_remaining", 0)
        processed = stats.get("memory_processed", 0)
        done = 0.0 if not total else 1.0 - remaining / total
        filled = int(done * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        line = (
            f"{self.label} [{bar}] {done:4.0%}  sent {processed / MIB:7.1f} MiB  "
            f"round {stats.get('memory_iteration', 0):>2}  "
            f"{time.monotonic() - self.start:5.1f} s"
        )
        if self.tty:
            self.stream.write("\r" + line)
        elif time.monotonic() - self.last_line >= 1.0:
            self.stream.write(line + "\n")
            self.last_line = time.monotonic()
        self.stream.flush()

    def note(self, text: str) -> None:
        """An event line, printed above the bar."""
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(f"  * {text}\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
