import ctypes
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


REPO_ROOT = os.path.dirname(os.path.dirname(PKG_DIR))


@pytest.fixture(scope="session")
def ringside_bin(tmp_path_factory):
    """The real sidecar binary, built once per test session from this tree
    (skips the tests that use it when the Go toolchain is missing), or the
    one $RINGSIDE_TEST_BIN names (to run the tests against another build)."""
    import shutil
    import subprocess

    given = os.environ.get("RINGSIDE_TEST_BIN")
    if given:
        return given

    go = shutil.which("go")
    if go is None:
        pytest.skip("the Go toolchain (go) is not on PATH: cannot build the ringside sidecar")
    out = str(tmp_path_factory.mktemp("ringside-bin") / "ringside")
    r = subprocess.run(
        [go, "build", "-o", out, "./cmd/ringside"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    if r.returncode != 0:
        pytest.fail("go build ./cmd/ringside failed:\n" + r.stdout + r.stderr)
    return out


# Under Yama ptrace_scope=1 a sidecar (our child) may not read our memory
# with process_vm_readv unless we allow it. Harmless where Yama is absent.
try:
    ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong((1 << 64) - 1), 0, 0, 0)
except Exception:  # noqa: BLE001 - not Linux
    pass


@pytest.fixture
def start_sidecar(ringside_bin):
    """Factory: start_sidecar(budget="16KiB", metrics=True, pool="256KiB", ...)
    -> ringside.sidecar_process.SidecarProcess (its keyword arguments; the
    tests' defaults: a 4 MiB pool of 4 KiB slots, 64 KiB rings). Each one
    is stopped after the test, which fails if it did not exit cleanly or left
    files behind."""
    from ringside.sidecar_process import SidecarProcess

    started = []

    def start(**kw):
        kw.setdefault("ring_capacity", "64KiB")
        sc = SidecarProcess(ringside_bin, **kw)
        started.append(sc)
        return sc

    yield start
    for sc in started:
        sc.stop()


@pytest.fixture
def sidecar(start_sidecar):
    """A sidecar with the tests' defaults (see start_sidecar)."""
    return start_sidecar()
