"""Failure classification and the re-attach policy of the engine plugins.

A plugin must never fail or hang a request over the cache: every sidecar
error is a miss (or a load error the engine recomputes). What differs is what
happens to the session:

- :data:`DROP`: the sidecar is gone or did not answer in time
  (RingsideUnavailable, RingsideTimeout). The session is dropped (the sidecar
  reclaims its leases, regions and writes) and the :class:`~ringside.client.Link`
  attaches again at most once per ``reattach_interval``.
- :data:`MISS`: the sidecar answered with an error (RingsideError with a
  status) or sent something undecodable (SchemaError): this call is a miss,
  the session stays.
- :data:`BUG`: anything else (a programming error): a miss too, logged once
  as a warning so that it is seen.
"""

from __future__ import annotations

import logging
from typing import Optional

from ..client import Link, RingsideError, RingsideTimeout, RingsideUnavailable
from ..ring import RingTooLarge
from ..schema import SchemaError
from .config import Config

DROP, MISS, BUG = "drop", "miss", "bug"

# The errors a sidecar call raises (client.py's module doc): a refusal or a
# lost sidecar, and arguments or replies that do not encode or decode.
SIDECAR_ERRORS = (RingsideError, SchemaError, RingTooLarge)


def classify(err: BaseException) -> str:
    """DROP, MISS or BUG (see the module doc)."""
    if isinstance(err, (RingsideUnavailable, RingsideTimeout)):
        return DROP
    if isinstance(err, SIDECAR_ERRORS):
        return MISS
    return BUG


def make_link(cfg: Config, attach: dict, miss_text: str = "serving without the cache") -> Link:
    """The plugin's re-attaching session to the configured sidecar."""
    return Link(cfg.socket_path(), cfg.timeout, cfg.reattach_interval, attach, miss_text=miss_text)


class Faults:
    """Applies the policy for one link: counts every error in
    ``stats["sidecar_errors"]``, drops the session on DROP, logs the rest."""

    def __init__(self, link: Optional[Link], stats: dict, logger: logging.Logger):
        self.link = link
        self.stats = stats
        self.logger = logger
        self._warned: set = set()

    def fail(self, err: BaseException, what: str = "", link: Optional[Link] = None) -> str:
        """Handle err from a sidecar call; returns its class."""
        self.stats["sidecar_errors"] += 1
        c = classify(err)
        lk = link if link is not None else self.link
        if c == DROP:
            if lk is not None:
                lk.drop(err)
        elif c == MISS:
            self.logger.debug("ringside: %s%s", what + ": " if what else "", err)
        else:
            self.warn_once(what or type(err).__name__, "ringside: %s failed: %r (treated as a miss)" % (what, err))
        return c

    def warn_once(self, tag: str, msg: str) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            self.logger.warning(msg)
