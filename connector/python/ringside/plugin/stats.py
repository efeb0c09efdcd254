"""Counters of an engine plugin, and their JSON file.

A plugin's counters are a plain dict of name -> int (cheap to bump on the
hot path, ``st["lookups"] += 1``), readable by tests and benchmarks
(``connector.stats``). With ``stats_path`` set, :class:`StatsFile` writes
them as ``<stats_path>.<role>.<pid>.json`` every ``stats_every`` ticks and
at shutdown, replacing the file atomically.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from typing import Optional

logger = logging.getLogger("ringside.stats")


def counters(names: Iterable[str], **fixed) -> dict:
    """A counter dict: every name at 0, plus fixed entries (e.g. role)."""
    d = dict(fixed)
    for n in names:
        d[n] = 0
    return d


class StatsFile:
    """Periodic JSON snapshots of a counter dict (see the module doc)."""

    def __init__(self, path: Optional[str], every: int, role: str, extra: Optional[Callable[[dict], None]] = None):
        self.path = path
        self.every = max(1, every)
        self.role = role.lower()
        self.extra = extra  # adds derived entries before a write
        self._ticks = 0

    def tick(self, stats: dict) -> None:
        """Count a step; write when stats_every steps have passed."""
        if not self.path:
            return
        self._ticks += 1
        if self._ticks >= self.every:
            self.write(stats)

    def write(self, stats: dict) -> None:
        self._ticks = 0
        if not self.path:
            return
        if self.extra is not None:
            self.extra(stats)
        path = "%s.%s.%d.json" % (self.path, self.role, os.getpid())
        tmp = path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(stats, f)
            os.replace(tmp, path)
        except OSError as e:
            logger.debug("ringside: stats: %s", e)
