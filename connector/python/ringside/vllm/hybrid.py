"""Admission of requests of a model with several KV cache groups (groups.py).

The single-group path (admission.py) looks a request's blocks up as one
prefix; here every group is looked up in its own digest domain and batch:

- Batches: group j of a request uses batch ``r.batch * len(groups) + j``.
  A full-attention group's batch holds its prefix ``[0, limit)``; a sliding
  window's holds the window being asked about (re-registered with
  FlagReplace when another window is asked about).
- Arrival (``on_new_request``): one PutHashes with FlagLookup|FlagReplace a
  group, published without waiting (one wake): every full-attention prefix
  up to the longest possible hit, and every window at that hit.
- ``get_num_new_matched_tokens`` collects those answers (within the step's
  wait budget, like the single-group lookup) and finds the longest hit every
  group can serve (groups.longest_hit). A window it needs that was not
  asked about ahead (a full-attention group cut the hit shorter, e.g. a
  conversation's next turn) is asked about then, synchronously
  (``window_probes``). The local index, when fresh, answers without the
  sidecar, as for one group.
- After allocation (``alloc``): each group's blocks to load are the
  non-null ones from the local hit to the hit's end (vLLM allocated null
  blocks outside a window); each becomes one Acquire of its own batch,
  re-registered to exactly those blocks. A load that cannot cover every
  group fails the whole request, which vLLM recomputes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Optional

from .. import schema as _s
from ..client import RingsideError, RingsideTimeout, Session
from ..mirror import Mirror
from ..plugin.faults import SIDECAR_ERRORS
from .admission import LOOKUP_REPLACE, Admission
from .groups import FULL, Layout, load_range, longest_hit
from .state import ReqState

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request


def known(w: Optional[list], lo: int, hi: int) -> int:
    """What a group's registered batch w = [wlo, whi, leading hits] says
    about its blocks [lo, hi): the leading present ones, or -1 if it cannot
    tell (not asked about, not answered yet, or past the first miss)."""
    if w is None or w[2] < 0:
        return -1
    wlo, whi, n = w
    if lo < wlo or hi > whi:
        return -1
    if n >= whi - wlo:
        return hi - lo
    miss = wlo + n
    if lo > miss:
        return -1
    return min(hi, miss) - lo


def register(s: Session, batch: int, digests: list[bytes], flags: int, wake: bool = False) -> int:
    """Register digests as batch, replacing what it held. With FlagLookup in
    flags, returns the seq of the record whose reply is the number of
    leading present blocks; else sends it without waiting (0)."""
    n = len(digests)
    lookup = bool(flags & _s.FLAG_LOOKUP)
    most = _s.MAX_HASHES_PER_RECORD
    if n <= most:
        p = _s.PUT_HASHES.pack(batch, n, flags) + b"".join(digests)
        if lookup:
            return s.submit(_s.TYPE_PUT_HASHES, p, wake=wake)
        s.send(_s.TYPE_PUT_HASHES, p, wake=wake)
        return 0
    for a in range(0, n, most):
        p = _s.PUT_HASHES.pack(batch, min(most, n - a), _s.FLAG_APPEND if a else _s.FLAG_REPLACE)
        s.send(_s.TYPE_PUT_HASHES, p + b"".join(digests[a : a + most]), wake=False)
    if lookup:
        return s.submit(_s.TYPE_LOOKUP, _s.encode_lookup(batch, 0, n), wake=wake)
    return 0


def reply_value(payload: Optional[bytes]) -> int:
    """A Reply's value; raises RingsideError for an error status."""
    if payload is None or len(payload) < 16:
        raise _s.SchemaError("Reply: %d bytes, want at least 16" % (len(payload or b"")))
    status, _, value = _s.REPLY.unpack_from(payload, 0)
    if status:
        rep = _s.decode_reply(payload)
        raise RingsideError(rep.status, rep.message)
    return value


class HybridAdmission:
    """Lookups and acquires of a model with several KV cache groups (module doc)."""

    def __init__(self, adm: Admission, layout: Layout):
        self.adm = adm  # admission.Admission: the request table, link, budget, index
        self.layout = layout
        self.groups = layout.groups
        self.n = len(layout.groups)
        self.lead = self.groups[layout.order[0]]
        self.stats = adm.stats

    def batch(self, r: ReqState, j: int) -> int:
        return r.batch * self.n + j

    def limit(self, request: "Request") -> int:
        """The most tokens a hit may cover: hashed ones, leaving at least one
        token to compute (vLLM needs a forward pass), in whole hit units."""
        lay = self.layout
        n = min(len(request.block_hashes) * lay.hash_block, request.num_tokens - 1)
        return n // lay.unit * lay.unit if n > 0 else 0

    def cursors(self, r: ReqState) -> list:
        if r.gstored is None:
            r.gstored = [0] * self.n
        return r.gstored

    # -- vLLM hooks ------------------------------------------------------------

    def on_new_request(self, request: "Request") -> None:
        adm = self.adm
        limit = self.limit(request)
        if limit <= 0:
            return
        s = adm.link.get()
        if s is None:
            return
        ix = adm.index
        if ix is not None and ix.mirror.state == Mirror.LIVE:
            try:
                if ix.usable(s, bool(adm.reqs)):
                    return  # looked up in the local index when vLLM asks
            except SIDECAR_ERRORS as e:
                adm.faults.fail(e)
                return
        try:
            r = adm.req(request)
            if r.registered:
                return
            hashes = request.block_hashes
            win: list = [None] * self.n
            seqs = []
            wake = not adm.woke
            for j in self.layout.order:
                g = self.groups[j]
                hi = limit // g.block_size
                lo = g.first_needed(limit)
                if hi <= lo:
                    continue
                seqs.append((j, register(s, self.batch(r, j), g.digests(hashes, lo, hi), LOOKUP_REPLACE, wake)))
                win[j] = [lo, hi, -1]
                wake = False
            adm.woke = True
            r.gwin, r.gseq = win, seqs
            r.lookup_t = time.monotonic()
            r.registered = r.lookup_count = limit
        except SIDECAR_ERRORS as e:
            adm.faults.fail(e)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        adm = self.adm
        limit = self.limit(request)
        if limit <= 0:
            return 0, False
        s = adm.link.get()
        if s is None:
            return 0, False
        again = False
        r = None
        try:
            r = adm.req(request)
            answered = False
            if r.gseq:
                if not self._collect(r, s, request.request_id):
                    return None, False  # not answered yet: vLLM asks again next step
                answered = True
            if answered and r.lookup_count == limit:
                hits = longest_hit(self.layout, limit, self._probe(r, s, limit))
            elif not answered and not r.allocated and r.looked == limit:
                hits = r.hits  # asked again while it waits for KV blocks: the last answer
                again = True
            else:  # not looked up ahead (busy engine, resumed, re-attached, or grown)
                r.gwin = None
                hits = self._mirror(r, s, limit)
                if hits < 0:
                    r.gwin = [None] * self.n
                    hits = longest_hit(self.layout, limit, self._probe(r, s, limit))
                    r.registered = limit
            # At least 0, and never past a load that failed for it (loads.py).
            hits = min(max(hits, 0), r.claim_cap)
        except SIDECAR_ERRORS as e:
            if r is not None:
                self._forget(r, s)
            adm.faults.fail(e)
            return 0, False
        r.looked, r.hits = limit, hits
        if not again:
            st = self.stats
            st["lookups"] += 1
            st["lookup_blocks"] += limit // self.lead.block_size
            st["hit_blocks"] += hits // self.lead.block_size
            if r.gwin is not None and hits < self._lead_hits(r, limit):
                st["group_cut_hits"] += 1
        ext = hits - num_computed_tokens
        if ext <= 0:
            return 0, False
        r.hit_tokens = hits
        return ext, True

    def alloc(self, r: ReqState, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> tuple:
        """The hit was allocated: (parts, flags) for Loads.acquire_parts, one
        part (batch, digests, engine block ids) a group with blocks to load;
        parts None if the hit cannot be loaded."""
        hit = r.hit_tokens
        local = hit - num_external_tokens
        cur = self.cursors(r)
        hashes = request.block_hashes
        parts: Optional[list] = None
        per_group = blocks.blocks if blocks is not None else ()
        try:
            got = []
            for j in self.layout.order:
                g = self.groups[j]
                blks = per_group[g.gid]
                a, e = load_range(g, blks, local, hit)
                cur[j] = max(cur[j], e)  # loaded blocks need no storing back
                if e > a:
                    got.append((self.batch(r, j), g.digests(hashes, a, e), [b.block_id for b in blks[a:e]]))
            parts = got
        except (ValueError, IndexError) as e:
            self.adm.faults.warn_once("load-range", "ringside: cannot load %s: %s" % (request.request_id, e))
        st = self.stats
        for batch, _, ids in parts or ():
            kind = self.groups[batch - r.batch * self.n].kind
            st["load_blocks_full" if kind == FULL else "load_blocks_window"] += len(ids)
        # Looked up in the local index (no batch registered): the sidecar's
        # lookup and hit counters see the hit through FlagLookup.
        return parts, (LOOKUP_REPLACE if r.gwin is None else _s.FLAG_REPLACE)

    # -- lookups ---------------------------------------------------------------

    def _collect(self, r: ReqState, s: Session, rid: str) -> bool:
        """Collect the lookups submitted ahead (within the step's budget):
        True once all are answered, False if vLLM should ask again next
        step. Raises like a session call (RingsideTimeout past the timeout)."""
        adm = self.adm
        win = r.gwin
        assert win is not None  # set with gseq (on_new_request)
        for j, seq in r.gseq:
            w = win[j]
            assert w is not None  # a group asked about has its window
            if w[2] >= 0:
                continue
            p = adm.budget.reply(s, seq)
            if p is None:
                if time.monotonic() - r.lookup_t < adm.timeout:
                    self.stats["deferred_lookups"] += 1
                    return False
                raise RingsideTimeout("lookup of %s got no reply in %.1fs" % (rid, adm.timeout))
            w[2] = reply_value(p)
        r.gseq = []
        return True

    def _forget(self, r: ReqState, s: Session) -> None:
        """Give up on the lookups submitted ahead (their batches may hold
        anything now: the next lookup registers them again)."""
        win = r.gwin
        for j, seq in r.gseq:
            w = win[j] if win is not None else None
            if w is not None and w[2] < 0:
                try:
                    s.forget(seq)
                except SIDECAR_ERRORS:
                    pass
        r.gseq = []
        r.gwin = None
        r.registered = 0

    def _probe(self, r: ReqState, s: Session, limit: int) -> Callable[[int, int, int], int]:
        """probe(j, lo, hi) for longest_hit over the sidecar: from what group
        j's batch was asked about, else asking now (a full-attention group
        registers its whole prefix, a window just itself)."""
        hashes = r.request.block_hashes
        timeout = self.adm.timeout
        win = r.gwin
        assert win is not None  # what each group's batch holds: set before the probes

        def probe(j: int, lo: int, hi: int) -> int:
            n = known(win[j], lo, hi)
            if n >= 0:
                return n
            g = self.groups[j]
            if g.kind == FULL:
                lo, hi = 0, limit // g.block_size
            seq = register(s, self.batch(r, j), g.digests(hashes, lo, hi), LOOKUP_REPLACE, True)
            w = win[j] = [lo, hi, -1]
            w[2] = reply_value(s.await_reply(seq, timeout=timeout))
            self.stats["window_probes"] += 1
            return known(w, lo, hi)

        return probe

    def _mirror(self, r: ReqState, s: Session, limit: int) -> int:
        """The hit in the local index, or -1 (not fresh, or a group's first
        miss is one of this engine's own recent stores: ask the sidecar)."""
        ix = self.adm.index
        if ix is None:
            return -1
        m = ix.mirror
        if not m.fresh(time.monotonic(), s):
            return -1
        ix.arrived = True
        hashes = r.request.block_hashes
        groups = self.groups

        def probe(j: int, lo: int, hi: int) -> int:
            return m.answer(groups[j].digests(hashes, lo, hi), hi - lo)

        hits = longest_hit(self.layout, limit, probe)
        if hits >= 0:
            st = self.stats
            st["mirror_lookups"] += 1
            st["mirror_hit_blocks"] += hits // self.lead.block_size
        return hits

    def _lead_hits(self, r: ReqState, limit: int) -> int:
        """What the lead group alone would serve (tokens), from its batch."""
        j = self.layout.order[0]
        w = r.gwin[j] if r.gwin is not None else None
        n = known(w, 0, limit // self.lead.block_size)
        return n * self.lead.block_size if n >= 0 else 0
