"""Build steps pyproject.toml cannot say: what the wheel leaves out, and its version.

The metadata lives in pyproject.toml; setuptools runs this file for the two
things below (``pip wheel``/``pip install`` of this directory, ``make dist``).

Left out: the package holds modules that only the tests and benchmarks run
(spawned as ``python -m ringside.<name>`` by Go tests and benchmarks, which
put this source tree on PYTHONPATH). They stay in the source tree, where
those callers find them, and are dropped from what build_py copies, so
neither the wheel nor the sdist ships them. tests/test_wheel.py builds the
wheel and checks its contents.

Version: the binaries' version (the Makefile's VERSION, ``git describe
--tags --always --dirty``) in PEP 440 form, from RINGSIDE_VERSION when set
(``make dist`` and the image builds set it), else from ``git describe`` run
here (a build from a checkout), else 0+unknown.
"""

from __future__ import annotations

import os
import re
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

# Modules of the `ringside` package that are not shipped: test and benchmark peers.
NOT_SHIPPED = {
    ("ringside", "_benchpeer"),  # the Python side of `ringside-bench ring`
    ("ringside", "_pollbench"),  # the python row of `ringside-bench poll`
    ("ringside", "_xproc"),  # the cross-process peer of the ring tests
    ("ringside", "sidecar_process"),  # starts a `ringside serve` for the tests and bench/vllm
}

_DESCRIBE = re.compile(r"^v?(\d+(?:\.\d+)*)(?:-(\d+)-g([0-9a-f]+))?(-dirty)?$")
_HASH = re.compile(r"^([0-9a-f]{4,40})(-dirty)?$")


def pep440(describe: str) -> str:
    """`git describe --tags --always --dirty` as a PEP 440 version.

    v1.2.3 -> 1.2.3; v1.2.3-4-gabc1234 -> 1.2.3.post4+gabc1234 (4 commits
    after the tag); a history without tags (abc1234) -> 0+gabc1234; a
    -dirty suffix adds the local label "dirty"; anything else (dev) -> 0+<it>
    with its characters outside [A-Za-z0-9.] turned into dots.
    """
    describe = describe.strip()
    m = _DESCRIBE.match(describe)
    if m:
        release, ahead, commit, dirty = m.groups()
        version = release + (f".post{ahead}" if ahead else "")
        local = [f"g{commit}"] if commit else []
    else:
        m = _HASH.match(describe)
        if m:
            version, local, dirty = "0", [f"g{m.group(1)}"], m.group(2)
        else:
            label = re.sub(r"[^A-Za-z0-9]+", ".", describe).strip(".") or "unknown"
            return f"0+{label}"
    if dirty:
        local.append("dirty")
    return version + ("+" + ".".join(local) if local else "")


def version() -> str:
    v = os.environ.get("RINGSIDE_VERSION", "").strip()
    if not v:
        try:
            here = os.path.dirname(os.path.abspath(__file__))
            v = subprocess.run(
                ["git", "describe", "--tags", "--always", "--dirty"],
                cwd=here,
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            v = "unknown"
    return pep440(v)


class BuildPy(build_py):
    """build_py without the modules of NOT_SHIPPED."""

    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir) if (m[0], m[1]) not in NOT_SHIPPED]


if __name__ == "__main__":
    setup(version=version(), cmdclass={"build_py": BuildPy})
