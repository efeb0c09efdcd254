"""The KV cache groups of a vLLM model, as the connector serves them.

With vLLM's hybrid memory allocator (HMA) a model's attention layers are
split into KV cache groups, one block table each: full-attention layers keep
every block of a request, sliding-window layers only the blocks inside the
window (vLLM frees the others and pads the table with its null block), and
state-space (mamba) layers one state block. Every group's block ``i`` is
identified by vLLM's block hash of the tokens up to its end; in the engine's
own prefix cache a block is keyed by (hash, group).

What the connector does with them (docs/architecture.md, "KV cache groups"):

- Served kinds: full attention (vLLM's FullAttentionSpec and MLA) and
  sliding windows (SlidingWindowSpec). Any other kind (mamba, chunked local
  attention, sinks, cross attention, ...) makes the connector refuse the
  model: it logs why and serves without the cache, never a wrong hit
  (:attr:`Layout.refusal`).
- Digests: each group has a digest domain of its own in the namespace. The
  lead group (the first full-attention group) uses vLLM's hashes as they
  are; the others XOR them with a 32-byte mask of their own
  (SHA-256 of the group's index), so a block stored for one group is never
  found by another group's lookup.
- Namespace: the layout fingerprint gets a ``groups`` part naming every
  group's kind, block size, window and layers, so two models, or one model
  with the hybrid allocator on and off, share blocks only when their groups
  are the same. A model with one plain full-attention group keeps the
  fingerprint it always had.
- A hit of ``H`` tokens needs, from every group, the blocks vLLM's prefix
  cache would need: full attention blocks ``[0, H)``, a sliding window the
  blocks inside the window of the hit's next token (vLLM's
  ``SlidingWindowManager.get_num_skipped_tokens``). :func:`longest_hit`
  finds the longest ``H`` that every group can serve, as vLLM's
  ``HybridKVCacheCoordinator.find_longest_cache_hit`` does for its own
  cache; only those blocks are loaded (vLLM allocated null blocks for the
  rest), and every full block a request computes is stored, as vLLM caches
  them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig

FULL, SLIDING = "full", "sliding"


class Group:
    """One KV cache group that the connector serves."""

    __slots__ = ("gid", "kind", "block_size", "window", "retained", "ratio", "mask", "layers")

    def __init__(
        self,
        gid: int,
        kind: str,
        block_size: int,
        window: int = 0,
        retained: int = 0,
        ratio: int = 1,
        layers: Sequence[str] = (),
        mask: int = 0,
    ):
        self.gid = gid  # vLLM's KV cache group id
        self.kind = kind  # FULL or SLIDING
        self.block_size = block_size  # tokens a block
        self.window = window  # sliding window in tokens (0: full attention)
        self.retained = retained  # vLLM's extra_retained_tokens below the window
        self.ratio = ratio  # block_size // hash block size
        self.layers = tuple(layers)
        self.mask = mask  # the digest domain (0: vLLM's hashes as they are)

    def first_needed(self, tokens: int) -> int:
        """The first block a hit of `tokens` tokens needs from this group: 0
        for full attention; for a sliding window the first block with a
        token inside the window of token `tokens` (vLLM's
        SlidingWindowManager.get_num_skipped_tokens, in blocks)."""
        if self.kind == FULL:
            return 0
        return max(0, tokens - self.window + 1 - self.retained) // self.block_size

    def digest(self, hashes: Sequence[bytes], i: int) -> bytes:
        """The digest of this group's block i (hashes: vLLM's block hashes,
        one per hash block)."""
        h = hashes[(i + 1) * self.ratio - 1]
        if not self.mask:
            return h
        n = len(h)
        return (int.from_bytes(h, "little") ^ (self.mask & ((1 << (8 * n)) - 1))).to_bytes(n, "little")

    def digests(self, hashes: Sequence[bytes], a: int, b: int) -> list:
        """digest(hashes, i) for i in [a, b)."""
        if not self.mask and self.ratio == 1:
            return list(hashes[a:b])
        return [self.digest(hashes, i) for i in range(a, b)]

    def describe(self) -> str:
        w = "w%d" % self.window if self.kind == SLIDING else ""
        r = "r%d" % self.retained if self.retained else ""
        return "%s%d%s%s" % (self.kind, self.block_size, w, r)

    def __repr__(self) -> str:
        return "Group(%d, %s, %d layers)" % (self.gid, self.describe(), len(self.layers))


def group_mask(gid: int) -> int:
    """The digest mask of vLLM's KV cache group gid (the lead group uses none)."""
    return int.from_bytes(hashlib.sha256(b"ringside/vllm kv cache group %d" % gid).digest(), "little")


class Layout:
    """The groups of one model as the connector serves them (module doc)."""

    def __init__(
        self,
        groups: Sequence[Group],
        unit: int,
        hash_block: int,
        refusal: str = "",
        plain: Optional[bool] = None,
    ):
        self.groups = tuple(groups)
        self.unit = unit  # hits are multiples of this many tokens (vLLM's scheduler block size)
        self.hash_block = hash_block  # tokens a vLLM block hash covers
        self.refusal = refusal  # why the connector cannot serve the model ("": it can)
        # One full-attention group hashed per block: the plain path, with the
        # fingerprint it always had.
        if plain is None:
            plain = len(self.groups) == 1 and self.groups[0].kind == FULL and self.groups[0].ratio == 1
        self.plain = plain
        # Lookup order: full attention first (a prefix: one lookup bounds the
        # others), then the sliding windows, as vLLM's coordinator does.
        self.order = tuple(sorted(range(len(self.groups)), key=lambda j: self.groups[j].kind != FULL))
        self.sliding = any(g.kind == SLIDING for g in self.groups)

    @classmethod
    def single(cls, block_size: int) -> "Layout":
        """One full-attention group (vLLM without KV cache groups, or a model
        with one kind of attention)."""
        return cls([Group(0, FULL, block_size)], block_size, block_size)

    def fingerprint_part(self) -> Optional[str]:
        """The ``groups`` part of the layout fingerprint, or None for the
        plain layout (whose fingerprint stays what it was)."""
        if self.plain:
            return None
        desc = "+".join("%sx%d" % (g.describe(), len(g.layers)) for g in self.groups)
        layers = hashlib.sha256("|".join(",".join(g.layers) for g in self.groups).encode()).hexdigest()[:12]
        return "%s.h%d.%s" % (desc, self.hash_block, layers)

    def __repr__(self) -> str:
        return "Layout(%s%s)" % (
            ", ".join(map(repr, self.groups)),
            ", refused: %s" % self.refusal if self.refusal else "",
        )


# -- reading vLLM's KV cache configuration ---------------------------------------------


def _spec_kind(spec: Any) -> tuple[Optional[str], str]:
    """(FULL or SLIDING, "") for a spec the connector serves, else (None, why)."""
    from vllm.v1 import kv_cache_interface as kci

    full = tuple(getattr(kci, n) for n in ("FullAttentionSpec", "MLAAttentionSpec") if hasattr(kci, n))
    sliding = getattr(kci, "SlidingWindowSpec", None)
    specs = [spec]
    uniform = getattr(kci, "UniformTypeKVCacheSpecs", None)
    if uniform is not None and isinstance(spec, uniform):
        specs = list(spec.kv_cache_specs.values())
    kinds: set[object] = set()  # FULL, or (SLIDING, window, retained tokens)
    for sp in specs:
        t = type(sp)
        if t in full:
            kinds.add(FULL)
        elif sliding is not None and t is sliding:
            kinds.add((SLIDING, int(sp.sliding_window), int(getattr(sp, "extra_retained_tokens", 0) or 0)))
        else:
            return None, _why_not(t.__name__)
    if len(kinds) != 1:
        return None, "a group mixes layers of different kinds (%s)" % sorted(map(str, kinds))
    k = kinds.pop()
    return (FULL, "") if k == FULL else (SLIDING, "")


def _why_not(name: str) -> str:
    if "Mamba" in name:
        return (
            "%s (state-space layers): their cached state is one block a boundary that vLLM "
            "relocates inside the block table and hands to connectors separately; ringside does "
            "not store or load it, and a hit without it would be wrong" % name
        )
    if "ChunkedLocal" in name:
        return "%s (chunked local attention) is not served" % name
    return "%s is not a kind of KV cache ringside serves (full attention, sliding windows)" % name


def _window_of(spec: Any) -> tuple[int, int]:
    specs = [spec]
    if hasattr(spec, "kv_cache_specs"):
        specs = list(spec.kv_cache_specs.values())
    sp = specs[0]
    return int(sp.sliding_window), int(getattr(sp, "extra_retained_tokens", 0) or 0)


def layout_of(vllm_config: "VllmConfig", kv_cache_config: Any) -> Layout:
    """The connector's view of the model's KV cache groups. vLLM versions
    whose connectors get no KV cache configuration have one group."""
    cc = vllm_config.cache_config
    bs = int(cc.block_size)
    groups_cfg = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups_cfg:
        return Layout.single(bs)
    unit, hash_block = _block_sizes(vllm_config, kv_cache_config, bs)
    groups = []
    refusal = ""
    for gid, g in enumerate(groups_cfg):
        spec = g.kv_cache_spec
        kind, why = _spec_kind(spec)
        if kind is None:
            refusal = refusal or "KV cache group %d: %s" % (gid, why)
            continue
        if not getattr(g, "enable_kv_transfer", True) or getattr(g, "host_resident", False):
            refusal = refusal or "KV cache group %d is not transferable (vLLM keeps it for itself)" % gid
            continue
        role = getattr(getattr(g, "role", None), "name", "DEFAULT")
        if role != "DEFAULT":
            refusal = refusal or "KV cache group %d has role %s" % (gid, role)
            continue
        if not getattr(spec, "prefix_cacheable", True):
            refusal = refusal or "KV cache group %d is not prefix-cacheable" % gid
            continue
        gbs = int(spec.block_size)
        if gbs % hash_block:
            refusal = refusal or "KV cache group %d: block size %d is not a multiple of the hash block size %d" % (
                gid,
                gbs,
                hash_block,
            )
            continue
        window, retained = _window_of(spec) if kind == SLIDING else (0, 0)
        groups.append(Group(gid, kind, gbs, window, retained, gbs // hash_block, list(g.layer_names)))
    if refusal:
        return Layout(groups, unit, hash_block, refusal, plain=False)
    lay = Layout(groups, unit, hash_block)
    if not lay.plain:
        refusal = _unsupported_setup(vllm_config)
        if refusal:
            return Layout(groups, unit, hash_block, refusal, plain=False)
        # The lead group keeps vLLM's hashes; every other one gets a domain.
        lead = lay.order[0]
        for j, g in enumerate(groups):
            if j != lead:
                g.mask = group_mask(g.gid)
    return lay


def _block_sizes(vllm_config: "VllmConfig", kv_cache_config: Any, bs: int) -> tuple[int, int]:
    """(scheduler block size, hash block size) as vLLM resolves them."""
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        unit, hb = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        return int(unit), int(hb)
    except Exception:  # noqa: BLE001 - older vLLM: one block size
        sizes = [int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups] or [bs]
        return math.lcm(*sizes), math.gcd(*sizes)


def _unsupported_setup(vllm_config: "VllmConfig") -> str:
    """Why a model with KV cache groups cannot be served in this setup ("" if it can)."""
    pc = vllm_config.parallel_config
    if int(getattr(pc, "pipeline_parallel_size", 1)) > 1:
        return "pipeline parallelism with KV cache groups (each stage sees other layers of a group)"
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(pc, name, 1) or 1) > 1:
            return "%s > 1 with KV cache groups" % name
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding with KV cache groups (vLLM drops draft blocks from hybrid hits)"
    return ""


# -- the longest hit every group can serve ------------------------------------------------------

# Lookups of one request's blocks in a group that may be asked (each a round
# trip on the sidecar path) before the request is taken as a miss.
MAX_PROBES = 16


def longest_hit(layout: Layout, limit: int, probe: Callable[[int, int, int], int]) -> int:
    """The longest hit, in tokens (a multiple of layout.unit, at most
    limit), that every group can serve; -1 if probe gave up.

    probe(j, lo, hi) -> how many of group j's blocks [lo, hi) are present,
    counted from lo up to the first missing one (hi - lo: all), or -1 (no
    answer: the caller asks elsewhere). A group that lacks a block the
    candidate needs moves the candidate down to that block, and every group
    is checked again there, until all agree (vLLM's coordinator does the
    same over its own cache): full-attention groups need their prefix, so
    a hit only shrinks; a sliding window needs the blocks inside it."""
    unit = layout.unit
    groups = layout.groups
    h = limit // unit * unit
    probes = 0
    while h > 0:
        for j in layout.order:
            g = groups[j]
            hi = h // g.block_size
            lo = g.first_needed(h)
            if hi <= lo:
                continue
            probes += 1
            if probes > MAX_PROBES * len(groups):
                return 0
            n = probe(j, lo, hi)
            if n < 0:
                return -1
            if n < hi - lo:
                h = (lo + n) * g.block_size // unit * unit
                break
        else:
            return h
    return 0


def load_range(g: Group, blocks: Sequence[Any], local: int, hit: int) -> tuple[int, int]:
    """The blocks of group g that a hit of `hit` tokens loads after `local`
    tokens found in vLLM's own prefix cache: (first, end) in block indices,
    from the first non-null block at or after the local hit to the hit's
    end (vLLM allocated null blocks for those outside a sliding window).
    Raises ValueError if a null block follows a real one in that range."""
    a = local // g.block_size
    e = hit // g.block_size
    while a < e and blocks[a].is_null:
        a += 1
    for i in range(a, e):
        if blocks[i].is_null:
            raise ValueError("group %d: null block %d inside the load range [%d, %d)" % (g.gid, i, a, e))
    return a, e
