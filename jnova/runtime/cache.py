"""In-memory cache of compiled steps, keyed by structural hash, with hit/miss counters."""
from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0


class ArtifactCache:
    """A process-wide map from structural hash to compiled artifact."""

    def __init__(self):
        self._entries: dict[str, object] = {}
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get(self, key: str):
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            return value

    def put(self, key: str, value) -> None:
        with self._lock:
            self._entries[key] = value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.stats = CacheStats()

    def __len__(self):
        return len(self._entries)


ARTIFACTS = ArtifactCache()
