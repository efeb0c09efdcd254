import os
import sys
import uuid

import pytest

PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if PKG_DIR not in sys.path:
    sys.path.insert(0, PKG_DIR)


def child_env():
    """Environment for a child python3 that imports ringside from this tree."""
    env = dict(os.environ)
    env["PYTHONPATH"] = PKG_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@pytest.fixture
def shm_path():
    """A unique path under /dev/shm (falls back to /tmp), removed afterwards."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    paths = []

    def make(tag="ring"):
        p = os.path.join(base, f"ringside-pytest-{os.getpid()}-{tag}-{uuid.uuid4().hex[:8]}")
        paths.append(p)
        return p

    yield make
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
