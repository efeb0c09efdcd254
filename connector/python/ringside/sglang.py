"""SGLang HiCache storage backend backed by the ringside sidecar.

Load it as a dynamic HiCache storage backend (L3)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "ringside",
        "module_path": "ringside.sglang", "class_name": "RingsideHiCacheStorage",
        "socket": "/dev/shm/ringside/ringside.sock"}'

SGLang builds it with ``RingsideHiCacheStorage(storage_config, kwargs)`` on
every tensor-parallel rank, then hands it the rank's host KV pool
(``register_mem_pool_host``).

How it works
------------
* **Zero-copy.** The host KV pool (``MHATokenToKVPoolHost``,
  ``MLATokenToKVPoolHost``, any layout whose ``get_data_page`` is a view) is
  registered with the sidecar as one region: region page ``p`` is host page
  ``p`` (token slots ``p*page_size ..``), described by one segment per
  contiguous run of ``get_data_page(p*page_size, flat=False)``, so a pool block
  holds exactly the bytes of SGLang's flat data page. ``batch_get_v1`` /
  ``batch_set_v1`` send page indices only and the sidecar copies straight
  into / out of the host pool pages; Python never touches page bytes. The
  backend sets ``interface_v1 = 1`` in the extra config it is given, which is
  what makes SGLang's cache controller pick the zero-copy methods for a
  ``dynamic`` backend.
* **Keys.** SGLang's page keys are hex SHA-256 chain digests. A key list is
  converted to binary digests (``bytes.fromhex``) and registered as a hash
  batch the first time it is seen; later calls whose keys are a run of a
  registered batch (the ``get`` after an ``exists``, the next 128-page chunk
  of a chain, with ``extra_info.prefix_keys``) reuse a view of it or append
  to it, so no key is converted or sent twice. A bounded LRU (``max_batches``)
  keeps recent batches; evicted ones are dropped on the sidecar. Keys that
  are not 64 hex digits (a key with a tenant or other suffix, a custom key)
  become ``sha256("ringside-sglang-key-v1\\0" + key)``: the suffix is part of
  the digest, the same on every engine. The ``tenant`` extra config key is
  the attach salt (a separate namespace).
* **Namespace.** Model name, and a layout fingerprint of everything that
  changes a page's bytes: pool class, host layout, dtype, page size in tokens
  and bytes, layers, heads, head dims, segment shape, pipeline stage and
  context-parallel shard. Two engines share pages only when both agree.
* **Tensor parallelism.** MHA: rank ``tp_rank`` of world ``tp_size``; each rank
  stores its own head shard and the sidecar counts a page only when every
  rank has stored it, so ``batch_exists`` gives every rank the same answer
  (SGLang also MIN-reduces it). MLA (replicated KV): every rank attaches as
  DCP rank ``dcp_rank`` of world ``dcp_size`` (rank 0 of 1 without DCP), so the
  one writer SGLang elects stores the page for all. All ranks of an engine
  share the instance id (extra config ``instance``, default derived from the
  parent pid: set it explicitly for multi-node TP).
* **Faults.** Nothing here raises into SGLang's storage threads: every sidecar
  call has a deadline and every error is a miss (``batch_exists`` 0,
  ``batch_get_v1`` False entries, ``batch_set_v1`` False entries). Without a
  sidecar, or after it dies, the backend re-attaches lazily (at most once per
  ``reattach_interval``). Each SGLang thread that calls the backend gets its
  own session (a Session is single-threaded), and each session registers the
  pool region itself.
* **Plain methods** (``get``/``set``/``exists``/``batch_get``/``batch_set``):
  SGLang calls the tensor forms only when ``interface_v1`` is 0. They work
  through a small staging buffer registered as a second region
  (``staging_pages`` pages): one sidecar copy plus one tensor copy per page.
* **Unsupported** (raise ``NotImplementedError``): the v2 pool-transfer
  methods (hybrid models: Mamba, SWA, DSA side pools) and ``clear``.

The extra config keys are those of ringside.plugin.config (the table in
docs/configuration.md); an unknown or mistyped key fails the backend's
construction. How to run it, and what is tested: docs/sglang.md.
Counters are in ``backend.stats``.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from . import schema as _s
from .client import Link, RingsideError, RingsideTimeout, RingsideUnavailable, Session
from .plugin import region as _region
from .plugin.config import SGLANG, Config
from .plugin.faults import Faults
from .plugin.namespace import fingerprint
from .plugin.stats import counters

logger = logging.getLogger("ringside.sglang")

REGION_POOL = 1  # the host KV pool
REGION_STAGING = 2  # staging pages of the plain (tensor) methods
DIGEST_WIDTH = 32
_KEY_DOMAIN = b"ringside-sglang-key-v1\x00"
_batch_ids = itertools.count(1)  # process-wide: every backend object and thread
_batch_ids_lock = threading.Lock()

__all__ = ["RingsideHiCacheStorage", "key_digest"]


def key_digest(key: str) -> bytes:
    """The 32-byte digest of one SGLang page key: the key's own bytes when it
    is 64 hex digits, else sha256 of a domain tag and the whole key (a tenant
    or other suffix thus changes the digest)."""
    if len(key) == 64:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.sha256(_KEY_DOMAIN + key.encode("utf-8", "surrogatepass")).digest()


def _digests(keys) -> bytes:
    try:
        return bytes.fromhex("".join(keys)) if all(len(k) == 64 for k in keys) else b"".join(map(key_digest, keys))
    except ValueError:
        return b"".join(map(key_digest, keys))


def _next_batch_id() -> int:
    with _batch_ids_lock:
        n = next(_batch_ids)
    # Batch ids are per engine instance, and every rank (and every thread) of
    # the instance registers its own: the pid keeps them apart.
    return ((os.getpid() & 0x3FFFFF) << 40) | (n & ((1 << 40) - 1))


# --------------------------------------------------------------------------
# Sessions


class _Link(Link):
    """One thread's sidecar session (see client.Link), plus the regions
    registered in it."""

    def __init__(self, socket: str, timeout: float, reattach: float, attach: dict):
        super().__init__(socket, timeout, reattach, attach, miss_text="HiCache storage misses")
        self.regions: dict = {}  # region id -> generation it was registered in


class _UnknownBatch(Exception):
    pass


class _KeyIndex:
    """Recent key lists -> registered hash batches (bounded LRU), shared by
    the threads of one backend. Batches belong to the engine instance, so a
    batch registered by one thread's session is visible to the others."""

    def __init__(self, max_batches: int):
        self.max_batches = max(1, max_batches)
        self.lock = threading.Lock()
        self.batches: "OrderedDict[int, list]" = OrderedDict()  # id -> keys
        self.where: dict = {}  # key -> (batch id, position)
        self.epoch: Optional[int] = None
        self.orphans: list = []  # evicted batch ids still to drop on the sidecar
        self.registered = 0  # keys sent to the sidecar (for tests)

    def reset(self, epoch: Optional[int]) -> None:
        self.batches.clear()
        self.where.clear()
        self.orphans.clear()
        self.epoch = epoch

    def resolve(self, s: Session, keys: List[str], prefix: Optional[List[str]]) -> Tuple[int, int]:
        """A (batch, start) view of keys, registering or appending what is new."""
        if self.epoch != s.info.epoch:  # a new sidecar: nothing we registered exists
            self.reset(s.info.epoch)
        n = len(keys)
        loc = self.where.get(keys[0])
        if loc is not None:
            b, p = loc
            bk = self.batches.get(b)
            if bk is not None and p < len(bk) and bk[p] == keys[0]:
                have = len(bk) - p
                if have >= n:
                    if bk[p : p + n] == keys:
                        self.batches.move_to_end(b)
                        return b, p
                elif bk[p:] == keys[:have]:
                    self._append(s, b, bk, keys[have:])
                    return b, p
        if prefix:
            loc = self.where.get(prefix[-1])
            if loc is not None:
                b, p = loc
                bk = self.batches.get(b)
                if bk is not None and p == len(bk) - 1 and bk[p] == prefix[-1]:
                    start = len(bk)
                    self._append(s, b, bk, keys)
                    return b, start
        b = _next_batch_id()
        bk = []
        self._put(s, b, keys, append=False)
        self.batches[b] = bk
        self._index(b, bk, keys)
        self._evict(s)
        return b, 0

    def _append(self, s: Session, b: int, bk: list, new: List[str]) -> None:
        self._put(s, b, new, append=True)
        self._index(b, bk, new)
        self.batches.move_to_end(b)

    def _index(self, b: int, bk: list, new: List[str]) -> None:
        where = self.where
        base = len(bk)
        for i, k in enumerate(new):
            where[k] = (b, base + i)
        bk.extend(new)

    def _put(self, s: Session, b: int, keys: List[str], append: bool) -> None:
        step = max(1, min(4096, (s.max_payload - 16) // DIGEST_WIDTH))
        for i in range(0, len(keys), step):
            s.put_hashes(b, _digests(keys[i : i + step]), append=append or i > 0)
        self.registered += len(keys)

    def _evict(self, s: Session) -> None:
        while len(self.batches) > self.max_batches:
            b, bk = self.batches.popitem(last=False)
            for i, k in enumerate(bk):
                if self.where.get(k) == (b, i):
                    del self.where[k]
            self.orphans.append(b)
        while self.orphans:
            b = self.orphans.pop()
            try:
                s.drop_hashes(b)
            except RingsideError:
                pass  # best effort; the batch dies with the instance anyway


# --------------------------------------------------------------------------
# Host pool geometry


@dataclass(frozen=True)
class PoolGeometry:
    """The host pool as one sidecar region: page p is the pool's data page
    at token index p * page_tokens (shape and dtype: of that page's view)."""

    region: _region.Region
    page_tokens: int
    shape: tuple
    dtype: Any

    @property
    def page_size(self) -> int:
        return self.region.page_size

    @property
    def page_count(self) -> int:
        return self.region.page_count


def describe_pool(pool: Any) -> PoolGeometry:
    """The host pool's geometry. Raises ValueError when it cannot be one region."""
    ps = int(pool.page_size)
    page_num = int(getattr(pool, "page_num", 0) or int(pool.size) // ps)
    if page_num < 1:
        raise ValueError("the host pool has no pages")

    def view(p: int) -> torch.Tensor:
        v = pool.get_data_page(p * ps, flat=False)
        if not isinstance(v, torch.Tensor) or v.device.type != "cpu":
            raise ValueError("get_data_page is not a CPU tensor")
        return v

    v0 = view(0)
    v1, vl = (view(1), view(page_num - 1)) if page_num > 1 else (None, None)
    # The flat page SGLang's plain get/set exchange is exactly these bytes.
    region = _region.from_page_views(v0, v1, vl, page_num)
    return PoolGeometry(region, ps, tuple(v0.shape), v0.dtype)


def _namespace(cfg: HiCacheStorageConfig, pool: Any, geom: PoolGeometry, world: int) -> str:
    parts = {
        "v": "sglang-hicache-1",
        "pool": type(pool).__name__,
        "layout": str(getattr(pool, "layout", "?")),
        "dtype": str(getattr(pool, "dtype", geom.dtype)),
        "page_tokens": geom.page_tokens,
        "page_bytes": geom.page_size,
        "page_shape": "x".join(map(str, geom.shape)),
        "segments": len(geom.region.segments) or 1,
        "layers": getattr(pool, "layer_num", "?"),
        "heads": getattr(pool, "head_num", "?"),
        "head_dim": getattr(pool, "head_dim", getattr(pool, "kv_lora_rank", "?")),
        "v_head_dim": getattr(pool, "v_head_dim", getattr(pool, "qk_rope_head_dim", "?")),
        "mla": int(bool(cfg.is_mla_model)),
        "world": world,
        "pp": "%d/%d" % (cfg.pp_rank, cfg.pp_size),
        "cp": "%d/%d" % (cfg.attn_cp_rank, cfg.attn_cp_size),
        "start_layer": getattr(pool, "start_layer", "?"),
        "keys": "sha256-hex",
    }
    return fingerprint(parts)


# --------------------------------------------------------------------------
# The backend


class RingsideHiCacheStorage(HiCacheStorage):
    """HiCache L3 storage whose pages live in a ringside sidecar."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        self.extra = extra
        # A misspelled or mistyped key fails here (SGLang's own keys pass).
        cfg = self.config = Config.parse(extra, SGLANG)
        self.socket = cfg.socket_path()
        self.timeout = cfg.timeout
        self.load_timeout = cfg.load_timeout
        self.save_timeout = cfg.save_timeout
        self.lease_ttl = cfg.lease_ttl
        self.reattach = cfg.reattach_interval
        self.staging_pages = cfg.staging_pages
        if storage_config.extra_config is not None and "interface_v1" not in extra:
            # SGLang picks batch_get_v1 / batch_set_v1 for a dynamic backend
            # only when the extra config says interface_v1: say it.
            storage_config.extra_config["interface_v1"] = 1
        sc = storage_config
        if sc.is_mla_model:  # replicated KV: one shard per DCP rank, written once
            self.rank, self.world = int(sc.dcp_rank), int(sc.dcp_size)
        else:
            self.rank, self.world = int(sc.tp_rank), int(sc.tp_size)
        inst = cfg.instance or "sglang-%d" % os.getppid()
        self.instance = "%s/dp%d/pp%d/cp%d" % (inst, sc.dp_rank, sc.pp_rank, sc.attn_cp_rank)
        self.model = cfg.model or str(sc.model_name or "unknown-model")
        self.salt = cfg.tenant
        self.mem_pool_host = None
        self.geometry: Optional[PoolGeometry] = None
        self.layout_fingerprint: Optional[str] = None
        self.disabled: Optional[str] = "no host pool registered yet"
        self._local = threading.local()
        self._links: List[_Link] = []
        self._links_lock = threading.Lock()
        self._index = _KeyIndex(cfg.max_batches)
        self._staging: Optional[torch.Tensor] = None
        self._staging_lock = threading.Lock()
        self.stats = counters(
            (
                "exists_calls",
                "exists_pages",
                "exists_hits",
                "get_calls",
                "get_pages",
                "got_pages",
                "set_calls",
                "set_pages",
                "stored_pages",
                "present_pages",
                "skipped_pages",
                "sidecar_errors",
            )
        )
        self.faults = Faults(None, self.stats, logger)
        logger.info(
            "ringside: HiCache storage backend for %s rank %d/%d (instance %s, socket %s)",
            self.model,
            self.rank,
            self.world,
            self.instance,
            self.socket,
        )

    # -- registration ----------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        try:
            geom = describe_pool(mem_pool_host)
        except Exception as e:  # noqa: BLE001 - an unsupported pool means misses, not a failed start
            self.disabled = "host pool %s cannot be registered: %s" % (type(mem_pool_host).__name__, e)
            logger.error("ringside: %s; HiCache storage disabled (all misses)", self.disabled)
            return
        self.geometry = geom
        self.layout_fingerprint = _namespace(self.storage_config, mem_pool_host, geom, self.world)
        self.disabled = None
        logger.info(
            "ringside: host pool %s: %d pages of %d bytes (%d tokens, %d segments)",
            type(mem_pool_host).__name__,
            geom.page_count,
            geom.page_size,
            geom.page_tokens,
            len(geom.region.segments) or 1,
        )

    def _link(self) -> _Link:
        link = getattr(self._local, "link", None)
        if link is None:
            attach = dict(
                instance=self.instance,
                model=self.model,
                layout=self.layout_fingerprint,
                salt=self.salt,
                role=_s.ROLE_WORKER,
                rank=self.rank,
                world_size=self.world,
                digest_width=DIGEST_WIDTH,
            )
            link = _Link(self.socket, self.timeout, self.reattach, attach)
            self._local.link = link
            with self._links_lock:
                self._links.append(link)
        return link

    def _session(self, staging: bool = False) -> Tuple[Optional[Session], Optional[_Link]]:
        if self.disabled is not None:
            self._warn_once("disabled", "ringside: HiCache storage disabled: %s" % self.disabled)
            return None, None
        link = self._link()
        s = link.get()
        if s is None:
            return None, link
        g = self.geometry
        if link.regions.get(REGION_POOL) != link.generation:
            if g.page_size > s.info.slot_bytes:
                self._warn_once(
                    "slot",
                    "ringside: a host page is %d bytes but the sidecar's slots are %d bytes: "
                    "start the sidecar with --pool.slot-bytes >= %d; HiCache storage misses until then"
                    % (g.page_size, s.info.slot_bytes, g.page_size),
                )
                return None, link
            s.allow_sidecar_ptrace()
            try:
                g.region.register(s, REGION_POOL)
            except RingsideError as e:
                self._fail(link, e, "registering the host pool")
                return None, link
            link.regions[REGION_POOL] = link.generation
        if staging and link.regions.get(REGION_STAGING) != link.generation:
            buf = self._staging_buffer()
            try:
                s.register_region(REGION_STAGING, buf.data_ptr(), buf.numel(), g.page_size, self.staging_pages)
            except RingsideError as e:
                self._fail(link, e, "registering the staging buffer")
                return None, link
            link.regions[REGION_STAGING] = link.generation
        return s, link

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.zeros((self.staging_pages, self.geometry.page_size), dtype=torch.uint8)
        return self._staging

    def _fail(self, link: Optional[_Link], e: Exception, what: str) -> None:
        self.faults.fail(e, what, link)

    def _warn_once(self, tag: str, msg: str) -> None:
        self.faults.warn_once(tag, msg)

    def _view(self, s: Session, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo]) -> Tuple[int, int]:
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        with self._index.lock:
            return self._index.resolve(s, keys, prefix)

    def _with_view(self, keys, extra_info, fn, staging: bool = False):
        """Run fn(session, batch, start) on a view of keys, re-registering once
        if the sidecar forgot the batch (all our sessions ended meanwhile)."""
        s, link = self._session(staging)
        if s is None:
            return None
        for attempt in (0, 1):
            try:
                b, start = self._view(s, keys, extra_info)
                return fn(s, b, start)
            except RingsideError as e:
                if e.status == _s.Status.UNKNOWN_BATCH and attempt == 0:
                    with self._index.lock:
                        self._index.reset(s.info.epoch)
                    continue
                self._fail(link, e, fn.__name__)
                return None
            except Exception as e:  # noqa: BLE001 - never into SGLang's storage threads
                self._fail(link, e, fn.__name__)
                return None
        return None

    def _pages(self, host_indices: torch.Tensor, n: int) -> Optional[List[int]]:
        ps = self.geometry.page_tokens
        if host_indices is None or host_indices.numel() < n * ps:
            return None
        first = host_indices[: n * ps : ps]
        if ps > 1 and bool((first % ps).any()):
            return None
        pages = (first // ps).tolist()
        if pages and (min(pages) < 0 or max(pages) >= self.geometry.page_count):
            return None
        return pages

    # -- exists ----------------------------------------------------------------

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Number of leading keys whose pages the sidecar holds (for every rank)."""
        if not keys:
            return 0
        self.stats["exists_calls"] += 1
        self.stats["exists_pages"] += len(keys)

        def lookup(s, b, start):
            return s.lookup(b, start, len(keys))

        n = self._with_view(list(keys), extra_info, lookup) or 0
        self.stats["exists_hits"] += n
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- zero-copy get / set ---------------------------------------------------

    def batch_get_v1(
        self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> List[bool]:
        """Copy the leading present pages straight into the host pool pages
        host_indices[i * page_size]; True for each page loaded."""
        n = len(keys)
        miss = [False] * n
        if n == 0:
            return []
        self.stats["get_calls"] += 1
        self.stats["get_pages"] += n
        if self.disabled is not None:
            return miss
        pages = self._pages(host_indices, n)
        if pages is None:
            self._warn_once("get-indices", "ringside: batch_get_v1 got host indices that are not page-aligned; miss")
            return miss

        def load(s, b, start):
            return self._load(s, b, start, n, REGION_POOL, pages)

        got = self._with_view(list(keys), extra_info, load) or 0
        self.stats["got_pages"] += got
        return [True] * got + [False] * (n - got)

    def _load(self, s: Session, b: int, start: int, n: int, region: int, pages: List[int]) -> int:
        lr = s.acquire(b, start, n, ttl=self.lease_ttl)
        if not lr.lease:
            return 0
        release = True
        try:
            state, blocks = lr.state, lr.blocks
            deadline = time.monotonic() + self.load_timeout
            pause = 0.0005
            while state == _s.State.WAITING:  # the sidecar's load budget is busy
                if time.monotonic() > deadline:
                    return 0
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
                # Each poll's reply counts the blocks the lease holds (fewer
                # than the acquire's when the shared tier's fetch came short).
                pr = s.poll(lr.lease)
                state, blocks = pr.state, pr.blocks
            if state not in (_s.State.READY, _s.State.LOADING, _s.State.LOADED):
                return 0
            k = min(blocks, n)
            if k <= 0:
                return 0
            seq = s.submit(_s.TYPE_LOAD, _s.encode_load(lr.lease, region, 0, pages[:k]))
            rep = _s.decode_reply(s.await_reply(seq, timeout=self.load_timeout))
            if rep.status != _s.Status.OK or rep.value != k:
                logger.debug("ringside: load: %s", rep)
                return 0
            return k
        except (RingsideUnavailable, RingsideTimeout):
            # The session is dropped by the caller: the sidecar then ends the
            # lease itself (and a late copy cannot outlive the session).
            release = False
            raise
        finally:
            if release:
                s.release(lr.lease)

    def batch_set_v1(
        self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> List[bool]:
        """Copy the host pool pages host_indices[i * page_size] into the
        sidecar as keys[i]; True for pages stored or already there. The sidecar
        reports counts, not which pages it skipped for lack of space, so a
        partial store answers True for the first stored+present pages."""
        n = len(keys)
        if n == 0:
            return []
        self.stats["set_calls"] += 1
        self.stats["set_pages"] += n
        if self.disabled is not None:
            return [False] * n
        pages = self._pages(host_indices, n)
        if pages is None:
            self._warn_once("set-indices", "ringside: batch_set_v1 got host indices that are not page-aligned")
            return [False] * n

        def store(s, b, start):
            return self._store(s, b, start, REGION_POOL, pages)

        ok = self._with_view(list(keys), extra_info, store) or 0
        return [True] * ok + [False] * (n - ok)

    def _store(self, s: Session, b: int, start: int, region: int, pages: List[int]) -> int:
        step = max(1, min(8192, (s.max_payload - 24) // 4))
        seqs = []
        for i in range(0, len(pages), step):
            chunk = pages[i : i + step]
            seqs.append(s.submit(_s.TYPE_STORE, _s.encode_store(b, start + i, len(chunk), region, chunk)))
        deadline = time.monotonic() + self.save_timeout
        ok, failed = 0, False
        for seq in seqs:
            rep = _s.decode_store_reply(s.await_reply(seq, timeout=max(deadline - time.monotonic(), 0.001)))
            self.stats["stored_pages"] += rep.stored
            self.stats["present_pages"] += rep.present
            self.stats["skipped_pages"] += rep.skipped
            if rep.status not in (_s.Status.OK, _s.Status.COPY_FAILED):
                logger.debug("ringside: store: %s", rep)
                failed = True
            if not failed:
                ok += rep.stored + rep.present
                failed = rep.skipped > 0 or rep.status != _s.Status.OK
        return ok

    # -- plain (tensor) methods, through the staging region ---------------------

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(
        self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> List[Optional[torch.Tensor]]:
        """Flat data pages (SGLang's get_data_page(flat=True) format) for the
        leading present keys, written into target_locations when given; None
        from the first missing key on."""
        n = len(keys)
        out: List[Optional[torch.Tensor]] = [None] * n
        if n == 0 or self.disabled is not None:
            return out
        g = self.geometry
        S = self.staging_pages
        with self._staging_lock:
            for c in range(0, n, S):
                ck = list(keys[c : c + S])
                k = len(ck)

                def load(s, b, start, k=k):
                    return self._load(s, b, start, k, REGION_STAGING, list(range(k)))

                got = self._with_view(ck, None, load, staging=True) or 0
                stg = self._staging
                for i in range(got):
                    t = target_locations[c + i] if target_locations is not None else None
                    if t is None:
                        t = torch.empty(g.shape, dtype=g.dtype).flatten()
                    if t.numel() * t.element_size() != g.page_size or not t.is_contiguous():
                        self._warn_once("get-target", "ringside: get: target is not one contiguous page")
                        return out
                    t.view(torch.uint8).view(-1).copy_(stg[i])
                    out[c + i] = t
                if got < k:
                    break
        return out

    def set(
        self,
        key: str,
        value: Optional[Any] = None,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: List[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        """Store flat data pages; True when every page is stored or present."""
        n = len(keys)
        if n == 0:
            return True
        if self.disabled is not None or values is None or len(values) < n:
            return False
        g = self.geometry
        S = self.staging_pages
        with self._staging_lock:
            for c in range(0, n, S):
                ck = list(keys[c : c + S])
                k = len(ck)
                s, _ = self._session(staging=True)
                if s is None:
                    return False
                stg = self._staging
                for i in range(k):
                    v = values[c + i]
                    if not isinstance(v, torch.Tensor) or v.numel() * v.element_size() != g.page_size:
                        self._warn_once("set-value", "ringside: set: value is not one page")
                        return False
                    stg[i].copy_(v.detach().contiguous().view(-1).view(torch.uint8))

                def store(s, b, start, k=k):
                    return self._store(s, b, start, REGION_STAGING, list(range(k)))

                if (self._with_view(ck, None, store, staging=True) or 0) != k:
                    return False
        return True

    # -- unsupported -----------------------------------------------------------

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        raise NotImplementedError(
            "ringside: the HiCache v2 pool-transfer interface (hybrid models with Mamba, "
            "SWA or DSA side pools) is not supported; use a plain KV model"
        )

    def batch_get_v2(self, transfers, extra_info=None):
        raise NotImplementedError("ringside: batch_get_v2 (hybrid-model side pools) is not supported")

    def batch_set_v2(self, transfers, extra_info=None):
        raise NotImplementedError("ringside: batch_set_v2 (hybrid-model side pools) is not supported")

    def clear(self) -> None:
        raise NotImplementedError("ringside: the sidecar has no clear operation; restart the sidecar to empty it")

    def get_stats(self):
        return None  # SGLang's StorageMetrics shape is not ours: counters are in self.stats

    # -- lifetime --------------------------------------------------------------

    def close(self) -> None:
        with self._links_lock:
            links, self._links = self._links, []
        for link in links:
            try:
                link.close()
            except Exception:  # noqa: BLE001
                pass
