"""A progress line on the terminal while a long compile runs (only when stderr is a terminal)."""
from __future__ import annotations

import sys
import time

MIN_ITEMS = 16  # fewer kernels than this compile too fast to need a progress line


class Progress:
    def __init__(self, what: str, total: int, stream=None):
        self.what, self.total, self.done = what, total, 0
        self.stream = stream or sys.stderr
        self.active = total >= MIN_ITEMS and getattr(self.stream, "isatty", lambda: False)()
        self.start = time.perf_counter()

    def __enter__(self):
        return self

    def step(self, n: int = 1) -> None:
        self.done += n
        if self.active:
            width = 30
            filled = width * self.done // max(self.total, 1)
            elapsed = time.perf_counter() - self.start
            self.stream.write(f"\rjnova: {self.what} [{'#' * filled}{'.' * (width - filled)}] "
                              f"{self.done}/{self.total} {elapsed:5.1f}s")
            self.stream.flush()

    def __exit__(self, *exc):
        if self.active:
            self.stream.write("\n")
            self.stream.flush()
        return False
