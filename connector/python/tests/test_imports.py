"""No module of the ringside package uses a private name of another one.

A name that starts with an underscore is its module's own: another module
that imports it (``from .schema import _PUT_HASHES``) or reads it through
the module (``schema._REPLY``) depends on what its owner may change at any
time, so the wire would again be known in two places. What one module
offers another is public (schema's record layouts are PUT_HASHES, REPLY,
...). A private module's public names are the package's own business
(schema.py re-exports the generated _wire_schema), but its private ones
are not.

This scans the package's source (ast, nothing is imported) and fails with
every such use.
"""

import ast
import os

from conftest import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "connector", "python", "ringside")


def _modules():
    for d, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")]
                parts = rel.split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                yield ".".join(parts), path, f == "__init__.py"


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(mod, is_pkg, level, module):
    """The absolute name of a `from ... import` source."""
    if level == 0:
        return module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def violations(mod, path, is_pkg):
    """Each use in module mod of a private name of another ringside module."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    aliases = {}  # local name -> the ringside module it is bound to
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "ringside":
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "ringside"
                    if any(_private(p) for p in a.name.split(".")):
                        out.append("%s:%d imports %s" % (mod, node.lineno, a.name))
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(mod, is_pkg, node.level, node.module)
            if src.split(".")[0] != "ringside" or src == mod:
                continue
            for a in node.names:
                if a.name == "*":
                    continue
                if _private(a.name):
                    out.append("%s:%d imports %s from %s" % (mod, node.lineno, a.name, src))
                aliases[a.asname or a.name] = src + "." + a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
            target = aliases.get(node.value.id)
            if target is not None and target != mod:
                out.append("%s:%d reads %s.%s (%s)" % (mod, node.lineno, node.value.id, node.attr, target))
    return out


def test_no_module_uses_a_private_name_of_another():
    found = []
    n = 0
    for mod, path, is_pkg in _modules():
        n += 1
        found += violations(mod, path, is_pkg)
    assert n > 20, "scanned %d modules of %s" % (n, PACKAGE)
    assert not found, "private names used across modules (make them public):\n" + "\n".join(found)


def test_the_scan_finds_what_it_forbids(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "from . import schema as _s\n"
        "from .schema import _PUT_HASHES, REPLY\n"
        "from ._wire_schema import *\n"
        "import ringside._xproc\n"
        "x = _s._REPLY\n"
        "y = _s.REPLY\n"
        "z = REPLY._private\n"
    )
    got = violations("ringside.vllm.m", str(src), False)
    assert got == [
        "ringside.vllm.m:2 imports _PUT_HASHES from ringside.vllm.schema",
        "ringside.vllm.m:4 imports ringside._xproc",
        "ringside.vllm.m:5 reads _s._REPLY (ringside.vllm.schema)",
        "ringside.vllm.m:7 reads REPLY._private (ringside.vllm.schema.REPLY)",
    ], got
