"""Log lines about what an engine's callers sent, safe to write.

A request body is the caller's: the name of a key in its
``kv_transfer_params``, or a value, may hold a newline, an ANSI escape or a
megabyte of text. Every such string reaches the log through :func:`shown`
(``repr``, so control characters are escaped, cut to :data:`SHOWN_CHARS`),
and the warnings go through a :class:`Limited` logger: a burst of
:data:`BURST` lines, then one every :data:`EVERY_S` seconds, each saying how
many were suppressed since the last one. Its memory is a few numbers, however
many callers or key names there are. The counters (the plugin's stats, by
reason) say how many requests carried what, so nothing is lost by the rate
limit.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

# The most characters of a caller's string that reach the log (its repr, cut).
SHOWN_CHARS = 64
# Warnings logged back to back before the rate limit starts, and the least
# time between two after that.
BURST = 10
EVERY_S = 10.0


def shown(x: Any, limit: int = SHOWN_CHARS) -> str:
    """x as a log may show it: its repr, at most limit characters (then
    '...' and the full length). repr escapes newlines and every other control
    character, so a caller's string cannot start a line of its own."""
    try:
        r = repr(x)
    except Exception:  # noqa: BLE001 - a caller's object whose repr fails: say what it is
        r = "<%s>" % type(x).__name__
    if len(r) <= limit:
        return r
    return "%s...(%d chars)" % (r[:limit], len(r))


class Limited:
    """A logger's warnings under a rate limit (see the module doc): a token
    bucket of BURST lines, refilled one every EVERY_S seconds."""

    __slots__ = ("logger", "burst", "every", "tokens", "t", "suppressed", "clock")

    def __init__(
        self,
        logger: logging.Logger,
        burst: int = BURST,
        every: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.logger = logger
        self.burst = burst
        self.every = every
        self.clock = clock
        self.tokens = float(burst)
        self.t = clock()
        self.suppressed = 0  # lines dropped since the last one logged

    def warning(self, msg: str, *args: Any) -> bool:
        """Log msg % args as a warning unless the rate limit drops it;
        whether it was logged. The args must already be safe (shown())."""
        return self.log(logging.WARNING, msg, *args)

    def info(self, msg: str, *args: Any) -> bool:
        """The same at level INFO (a line dropped because INFO is off still
        takes its place in the bucket)."""
        return self.log(logging.INFO, msg, *args)

    def log(self, level: int, msg: str, *args: Any) -> bool:
        """Log msg % args at level unless the rate limit drops it."""
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.t) / self.every)
        self.t = now
        if self.tokens < 1.0:
            self.suppressed += 1
            return False
        self.tokens -= 1.0
        if self.suppressed:
            msg += " (%d similar " + ("warnings" if level == logging.WARNING else "lines") + " suppressed)"
            args = args + (self.suppressed,)
            self.suppressed = 0
        self.logger.log(level, msg, *args)
        return True
