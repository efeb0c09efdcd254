"""The vLLM releases the connector supports, and the check that refuses
any other at the engine's start (docs/vllm.md, "Versions").

Policy: the two newest minor releases of vLLM, every patch release of
each. A release is supported once the connector's conformance test
(tests/test_vllm_versions.py) checks it; the oldest one is dropped when a
new one is added. Standard library only: importable without vLLM."""

from __future__ import annotations

import re
from typing import Optional

# (major, minor), oldest first.
SUPPORTED: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))


class UnsupportedVLLM(RuntimeError):
    """The running vLLM is not one the connector supports."""


def supported_text() -> str:
    """The supported releases for a message: "0.32 and 0.33"."""
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
        "(the two newest minor releases, any patch release; docs/vllm.md, Versions). "
        "Install a supported vLLM, or a ringside release that supports this one." % (version, supported_text())
    )
