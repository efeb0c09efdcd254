"""The wheel `make dist` ships: built here with pip from a copy of this
directory, then read back. It holds every product module of the `ringside`
package and none of the test and benchmark peers (setup.py's NOT_SHIPPED),
the repository's LICENSE, the Apache-2.0 license expression, the vLLM plugin
entry point, and the version setup.py derives from the binaries' version.

The build runs without build isolation (no index needed) on this
interpreter's setuptools, pinned in requirements-test.txt.
"""

import ast
import email.parser
import os
import runpy
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest
from conftest import PKG_DIR, REPO_ROOT

# The modules only tests and benchmarks run (Go tests and benchmarks spawn
# them with `python -m ringside.<name>`, tests/conftest.py and bench/vllm
# import sidecar_process): never in the wheel.
PEERS = {"_benchpeer", "_pollbench", "_xproc", "sidecar_process"}

DESCRIBE = "v1.2.3-4-gabc1234-dirty"  # a `git describe` the Makefile's VERSION could be
WANT_VERSION = "1.2.3.post4+gabc1234.dirty"


def setup_module_globals():
    return runpy.run_path(os.path.join(PKG_DIR, "setup.py"), run_name="ringside_setup")


def source_modules():
    """Every module of the package in this tree, as dotted names."""
    out = set()
    root = os.path.join(PKG_DIR, "ringside")
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), PKG_DIR)[: -len(".py")]
                out.add(rel.replace(os.sep, "."))
    return out


def setuptools_version():
    try:
        import setuptools
    except ImportError:
        return None
    return tuple(int(x) for x in setuptools.__version__.split(".")[:2])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    v = setuptools_version()
    if v is None or v < (77, 0):
        msg = f"setuptools >= 77 is needed to build the wheel (have {v}): pip install -r requirements-test.txt"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    # A copy: an in-tree build would leave build/ and *.egg-info here.
    shutil.copytree(
        PKG_DIR,
        src,
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "build", "*.egg-info", "tests"),
    )
    out = tmp / "out"
    env = dict(os.environ, RINGSIDE_VERSION=DESCRIBE)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--disable-pip-version-check", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout}\n{r.stderr}"
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_not_shipped_is_the_peers():
    """setup.py leaves out exactly the peers, and each still exists here."""
    g = setup_module_globals()
    assert g["NOT_SHIPPED"] == {("ringside", p) for p in PEERS}
    for p in PEERS:
        assert os.path.isfile(os.path.join(PKG_DIR, "ringside", p + ".py")), p


def test_wheel_contents(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        shipped = {n[: -len(".py")].replace("/", ".") for n in names if n.startswith("ringside/") and n.endswith(".py")}
        others = [n for n in names if not n.startswith("ringside/") and ".dist-info/" not in n]
        assert not others, f"files outside the package: {others}"
        product = source_modules() - {f"ringside.{p}" for p in PEERS}
        assert {"ringside", "ringside.client", "ringside.vllm", "ringside.sglang"} <= {
            m.removesuffix(".__init__") for m in product
        }
        leaked = {f"ringside.{p}" for p in PEERS} & shipped
        assert not leaked, f"test/bench peers in the wheel: {sorted(leaked)}"
        missing = product - shipped
        assert not missing, f"product modules missing from the wheel: {sorted(missing)}"
        assert shipped == product

        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(info + "/METADATA").decode())
        assert meta["Name"] == "ringside"
        assert meta["Version"] == WANT_VERSION
        assert meta["License-Expression"] == "Apache-2.0"
        with open(os.path.join(REPO_ROOT, "LICENSE"), "rb") as f:
            assert z.read(info + "/licenses/LICENSE") == f.read(), "the wheel's LICENSE is not the repository's"
        eps = z.read(info + "/entry_points.txt").decode()
        assert "[vllm.general_plugins]" in eps and "ringside = ringside.vllm:register_plugin" in eps
    assert wheel.name == f"ringside-{WANT_VERSION}-py3-none-any.whl"


def test_wheel_imports_without_peers(wheel, tmp_path):
    """Every shipped module imports from the wheel alone; a missing engine
    (vllm, torch, sglang) is fine, a missing ringside module is not."""
    code = textwrap.dedent(
        """
        import importlib, sys, zipfile
        whl, bad = sys.argv[1], []
        names = zipfile.ZipFile(whl).namelist()
        mods = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in names
                      if n.startswith("ringside/") and n.endswith(".py"))
        for m in mods:
            try:
                mod = importlib.import_module(m)
            except ModuleNotFoundError as e:
                if (e.name or "").split(".")[0] in ("ringside", ""):
                    bad.append(f"{m}: {e}")
                continue
            if not mod.__file__.startswith(whl):
                bad.append(f"{m} imported from {mod.__file__}, not the wheel")
        sys.exit("\\n".join(bad) or None)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(wheel)
    r = subprocess.run([sys.executable, "-c", code, str(wheel)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"


def test_no_product_module_imports_a_peer():
    for m in source_modules() - {f"ringside.{p}" for p in PEERS}:
        path = os.path.join(PKG_DIR, *m.split(".")) + ".py"
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                targets = [base] + [f"{base}.{a.name}" if base else a.name for a in node.names]
            for t in targets:
                for p in PEERS:
                    assert not (t == f"ringside.{p}" or t.endswith(f".{p}") or t == p), f"{m} imports the peer {p}"


def test_license_copy():
    with open(os.path.join(REPO_ROOT, "LICENSE"), "rb") as a, open(os.path.join(PKG_DIR, "LICENSE"), "rb") as b:
        assert a.read() == b.read(), "connector/python/LICENSE differs from the repository's LICENSE"


@pytest.mark.parametrize(
    "describe,want",
    [
        ("v1.2.3", "1.2.3"),
        ("1.2", "1.2"),
        ("v1.2.3-4-gabc1234", "1.2.3.post4+gabc1234"),
        ("v1.2.3-4-gabc1234-dirty", "1.2.3.post4+gabc1234.dirty"),
        ("v1.2.3-dirty", "1.2.3+dirty"),
        ("cec8827", "0+gcec8827"),
        ("cec8827-dirty", "0+gcec8827.dirty"),
        ("dev", "0+dev"),
        ("", "0+unknown"),
        ("weird/tag_name", "0+weird.tag.name"),
    ],
)
def test_pep440(describe, want):
    assert setup_module_globals()["pep440"](describe) == want
