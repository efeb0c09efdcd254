"""The performance idioms of ringside/hot_paths.py appear nowhere else.

Scans the package's source (ast, nothing imported) for

- module-level aliases of enum members (``_READY = LoadState.READY``, a
  tuple of them) and of clocks (``_monotonic = time.monotonic``, ``from
  time import monotonic``): each may be read only in a function listed in
  HOT_PATHS;
- hooks bound over methods: ``setattr(self, ...)``, or ``self.m = ...``
  where m is a method of the class: nowhere outside HOT_PATHS;

and checks that every HOT_PATHS entry is a function of the package with a
step-benchmark row.
"""

import ast
import os
import re

from conftest import REPO_ROOT

from ringside.hot_paths import HOT_PATHS

PACKAGE = os.path.join(REPO_ROOT, "connector", "python", "ringside")
CLOCKS = {"monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "thread_time", "thread_time_ns", "time"}
CLASS = re.compile(r"^_?[A-Z][a-z0-9]+[A-Za-z0-9]*$")  # LoadState, Status
MEMBER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # READY, OK


def _modules():
    for d, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")]
                yield rel.replace(os.sep, ".").removesuffix(".__init__"), path


def _is_member(node):
    """An enum member read through its class: X.Cls.MEMBER or Cls.MEMBER."""
    if isinstance(node, ast.Tuple):
        return bool(node.elts) and all(_is_member(e) for e in node.elts)
    if not isinstance(node, ast.Attribute) or not MEMBER.match(node.attr):
        return False
    v = node.value
    name = v.attr if isinstance(v, ast.Attribute) else v.id if isinstance(v, ast.Name) else ""
    return bool(CLASS.match(name))


def _is_clock(node):
    return (
        isinstance(node, ast.Attribute)
        and node.attr in CLOCKS
        and isinstance(node.value, ast.Name)
        and node.value.id == "time"
    )


def _aliases(tree):
    """Module-level names bound to enum members or clocks."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "time":
            out.update(a.asname or a.name for a in node.names if a.name in CLOCKS)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if _is_member(node.value) or _is_clock(node.value):
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            out.add(n.id)
    return out


def _functions(tree, prefix=""):
    """(qualified name, node, enclosing class) of every function."""
    for node in tree.body if hasattr(tree, "body") else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")


def violations(mod, tree):
    out = []
    aliases = _aliases(tree)
    for qual, fn in _functions(tree):
        name = mod + "." + qual
        if name in HOT_PATHS:
            continue
        for n in ast.walk(fn):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in aliases:
                out.append("%s reads the alias %s (line %d)" % (name, n.id, n.lineno))
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and n.func.id == "setattr"
                and n.args
                and isinstance(n.args[0], ast.Name)
                and n.args[0].id == "self"
            ):
                out.append("%s binds an attribute of self with setattr (line %d)" % (name, n.lineno))
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        methods = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for fn in cls.body:
            if (
                not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                or mod + "." + cls.name + "." + fn.name in HOT_PATHS
            ):
                continue
            for n in ast.walk(fn):
                if (
                    isinstance(n, ast.Attribute)
                    and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name)
                    and n.value.id == "self"
                    and n.attr in methods
                ):
                    out.append(
                        "%s.%s.%s binds self.%s over the method (line %d)" % (mod, cls.name, fn.name, n.attr, n.lineno)
                    )
    # A module-level statement that reads an alias (other than defining it).
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and (_is_member(node.value) or _is_clock(node.value)):
            continue
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in aliases:
                out.append("%s reads the alias %s at module level (line %d)" % (mod, n.id, n.lineno))
    return out


def _trees():
    for mod, path in _modules():
        with open(path) as f:
            yield mod, ast.parse(f.read(), path)


def test_idioms_only_in_hot_paths():
    found = []
    for mod, tree in _trees():
        found += violations(mod, tree)
    assert not found, "performance idioms outside ringside/hot_paths.py (write plain Python, or list the function "
    "there with the step-benchmark row that guards it):\n" + "\n".join(found)


def test_hot_paths_are_functions_with_a_benchmark_row():
    functions = {mod + "." + qual for mod, tree in _trees() for qual, _ in _functions(tree)}
    for name, row in HOT_PATHS.items():
        assert name in functions, "HOT_PATHS lists %s, no function of the package" % name
        assert re.match(r"^vllm_step(_sustained)? model=(full|sliding) kv_events=(off|vllm|on): [a-z_]+$", row), row


def test_the_scan_finds_what_it_forbids():
    src = (
        "import time\n"
        "from time import perf_counter_ns\n"
        "from . import schema as _s\n"
        "_OK = _s.Status.OK\n"
        "_A, _B = (LoadState.A, LoadState.B)\n"
        "_mono = time.monotonic\n"
        "_PLAIN = _s.MAX_HASHES\n"
        "class C:\n"
        "    def __init__(self, side):\n"
        "        self.hook = side.hook\n"
        "        setattr(self, 'run', side.run)\n"
        "    def hook(self):\n"
        "        return _OK, _A, _mono(), perf_counter_ns(), _PLAIN, time.monotonic()\n"
    )
    got = violations("ringside.x", ast.parse(src))
    assert got == [
        "ringside.x.C.__init__ binds an attribute of self with setattr (line 11)",
        "ringside.x.C.hook reads the alias _OK (line 13)",
        "ringside.x.C.hook reads the alias _A (line 13)",
        "ringside.x.C.hook reads the alias _mono (line 13)",
        "ringside.x.C.hook reads the alias perf_counter_ns (line 13)",
        "ringside.x.C.__init__ binds self.hook over the method (line 10)",
    ], got
