"""The store planner: which blocks of which requests become full in a step.

Pure: it reads vLLM's SchedulerOutput and requests and writes the step's
stores into the metadata (digests and engine block ids, in the same order,
and the requests whose blocks they are); no sidecar, no I/O. The workers store those blocks after the forward pass
that fills them (worker.py).

Cost follows the requests that can fill a block this step, not all scheduled
ones: new and resumed requests and prefill chunks are checked every step they
are scheduled ("watched"); a decoding request (one token a step) is checked
again only in the step in which its next block can fill (a calendar of
steps), or later if it was not scheduled then (it is checked and planned
again). With speculative decoding (several tokens a step) every scheduled
request is checked every step.

Each request has a cursor (ReqState.stored): blocks [0, stored) were planned
for storing, or loaded from the sidecar. A block is full when every one of its
tokens has KV after this step (num_computed_tokens + scheduled tokens) and
vLLM has hashed it (request.block_hashes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from .engine import group_tables, null_block_id, single_group_blocks
from .groups import Group, Layout
from .metadata import RingsideConnectorMetadata
from .state import ReqState

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.core.sched.output import SchedulerOutput


class StorePlanner:
    """Plans the stores of each step (see the module doc)."""

    def __init__(
        self,
        reqs: dict[str, ReqState],
        block_size: int,
        every_step: bool,
        stats: dict,
        layout: Optional[Layout] = None,
        decode_every: int = 1,
        describe: bool = False,
    ):
        self.reqs = reqs  # the scheduler side's request table (shared)
        self.block_size = block_size
        # Several KV cache groups (groups.py): every group's blocks are
        # planned, each with its own cursor and digests; null blocks (vLLM's
        # padding outside a sliding window) are never stored.
        self.groups: tuple[Group, ...] = layout.groups if layout is not None and not layout.plain else ()
        # KV events' group (events.lead_group): full attention, vLLM's hashes,
        # no null blocks, so its stored blocks are one contiguous run.
        self.lead = next(
            (g for g in self.groups if g.kind == "full" and not g.mask and g.ratio == 1),
            None,
        )
        # Per group, the manager's request -> blocks table (like req_to_blocks).
        self.group_tables: Optional[list] = None
        self.null_id = 0  # vLLM's null block
        self.every_step = every_step  # speculative decoding: check every scheduled request
        # Blocks filled by decoding: stored in the step that fills them (1),
        # in steps that are multiples of decode_every (> 1), or never (0).
        self.decode_every = decode_every
        # Steps until vLLM has processed a step's output (max_concurrent_batches):
        # how long another connector's freshly loaded blocks wait (_check).
        self.ext_defer = 1
        self.stats = stats
        self.step = 0  # the scheduler step being planned (1, 2, ...)
        # The KV cache manager's request -> blocks table (single KV cache
        # group), None to resolve block ids through the scheduler output
        # (both known from the first step on: begin_step).
        self.req_to_blocks: Optional[dict] = None
        self._tables_known = False
        self.mine: Optional[set[bytes]] = None  # where the step's digests are noted (the local index's own stores)
        # The step's runs (request, first block, end block) for KV events'
        # descriptions (events.py: take_runs), None when events are off.
        self.runs: Optional[list[tuple[Any, int, int]]] = [] if describe else None
        self._watch: set[str] = set()
        self._due: dict[int, list[str]] = {}
        # Requests preempted and not scheduled since: counted as resumed when
        # they are (Model Runner V2 schedules them as new requests).
        self._preempted: set[str] = set()
        # Block ids (a list a KV cache group), for vLLM without kv_connector_block_state.
        self._legacy: dict[str, list[list[int]]] = {}

    def begin_step(self, kvm: Any, mine: Optional[set[bytes]]) -> None:
        """Start the next step: advance self.step; the first time, take the
        KV cache manager's block tables (kvm: vLLM's KV cache manager, None
        while vLLM has not bound it); note the step's digests in mine (the
        local index's set of this engine's own stores, or None)."""
        self.step += 1
        if not self._tables_known:
            self._tables_known = True
            self.req_to_blocks = single_group_blocks(kvm)
            if self.groups:
                self.group_tables = group_tables(kvm, [g.gid for g in self.groups])
                self.null_id = null_block_id(kvm)
        self.mine = mine

    def take_runs(self) -> list[tuple[Any, int, int]]:
        """The store runs planned since the last call (request, first block,
        end block), for KV events' descriptions; empty when events are off."""
        runs = self.runs
        if not runs:
            return []
        self.runs = []
        return runs

    def plan(self, meta: RingsideConnectorMetadata, so: "SchedulerOutput") -> None:
        """The stores of step self.step (call after begin_step)."""
        state = getattr(so, "kv_connector_block_state", None)
        resolve = getattr(state, "resolve_block_ids", None)
        nst = so.num_scheduled_tokens
        check = self._check_groups if self.groups else self._check
        if resolve is None or self.every_step:
            # vLLM without per-request block resolution, or speculative
            # decoding: check every scheduled request.
            if resolve is None:
                resolve = self._legacy_blocks(so)
            for rid in nst:
                check(rid, nst, resolve, meta)
        else:
            watch = self._watch
            for nr in so.scheduled_new_reqs:
                watch.add(nr.req_id)
            resumed = getattr(so.scheduled_cached_reqs, "resumed_req_ids", None)
            if resumed:
                watch.update(resumed)
                self.stats["resumed"] += len(resumed)
            pre = self._preempted
            if pre:
                if resumed:
                    pre.difference_update(resumed)
                back = [nr.req_id for nr in so.scheduled_new_reqs if nr.req_id in pre]
                if back:  # resumed as new requests (Model Runner V2)
                    pre.difference_update(back)
                    self.stats["resumed"] += len(back)
            step = self.step
            due = self._due.pop(step, None)
            if due:
                reqs = self.reqs
                for rid in due:
                    r = reqs.get(rid)
                    if r is not None and r.due == step and rid not in watch:
                        check(rid, nst, resolve, meta)
            if watch:
                for rid in list(watch):
                    check(rid, nst, resolve, meta)
        if meta.store_digests:
            st = self.stats
            st["planned_stores"] += len(meta.store_digests)
            st["planned_blocks"] += len(meta.store_block_ids)

    def forget(self, rid: str) -> None:
        """A finished request (an entry left in the calendar is skipped: it has no state)."""
        if self._legacy:
            self._legacy.pop(rid, None)
        if self._preempted:
            self._preempted.discard(rid)
        self._watch.discard(rid)

    def preempted(self, rids: Any) -> None:
        """Requests preempted in the step being planned."""
        self._preempted.update(rids)

    def _check(self, rid: str, nst: dict, resolve: Callable, meta: RingsideConnectorMetadata) -> None:
        r = self.reqs.get(rid)
        if r is None:
            self._watch.discard(rid)
            return
        req = r.request
        n = nst.get(rid, 0)
        done = req.num_computed_tokens + n  # tokens whose KV exists after this step
        bs = self.block_size
        hashes = req.block_hashes
        full = done // bs
        if full > len(hashes):
            full = len(hashes)
        if not self.decode_every:
            full = self._prompt_only(req, full)
        a = r.stored
        if r.local >= 0:
            # Its first step after vLLM asked for its hit: tokens computed
            # now but not then, that ringside did not load (a loaded block
            # moved the cursor), came from another connector's load in this
            # step (MultiConnector). A synchronous load that failed is only
            # reported with the step's output, after the workers' stores:
            # those blocks wait until vLLM has seen it (and truncated the
            # request's computed tokens, or not).
            lb = max(a, r.local // bs)
            if req.num_computed_tokens // bs > lb:
                r.ext_from, r.ext_step = lb, self.step + self.ext_defer
                self.stats["deferred_external_blocks"] += req.num_computed_tokens // bs - lb
            r.local = -1
        if r.ext_step:
            if self.step < r.ext_step:
                full = min(full, r.ext_from)
            else:
                r.ext_step = 0
        if full > a:
            rtb = self.req_to_blocks
            if rtb is not None:  # the manager's own block list: no copy of the whole table
                blks = rtb.get(rid) or ()
                if full > len(blks):
                    full = len(blks)
                if full == a + 1:  # the common case: one block filled (decoding)
                    meta.store_block_ids.append(blks[a].block_id)
                elif full > a:
                    meta.store_block_ids.extend([b.block_id for b in blks[a:full]])
            else:
                try:
                    got = resolve(rid)
                except (KeyError, IndexError, AttributeError):  # no blocks (freed): nothing to store
                    got = None
                blocks = got[0] if got else ()
                if full > len(blocks):
                    full = len(blocks)
                if full > a:
                    meta.store_block_ids.extend(blocks[a:full])
            if full > a:
                mine = self.mine
                if full == a + 1:
                    meta.store_digests.append(hashes[a])
                    if mine is not None:
                        mine.add(hashes[a])
                else:
                    meta.store_digests.append(b"".join(hashes[a:full]))
                    if mine is not None:
                        mine.update(hashes[a:full])
                if self.runs is not None:
                    self.runs.append((req, a, full))
                meta.store_req_ids.append(rid)
                r.stored = full
                r.store_step = self.step
        if self.every_step:
            return
        if n == 0 or done < req.num_tokens:
            # Not scheduled (preempted or skipped), or a prefill chunk: watch
            # it while it is scheduled; a preempted one comes back as resumed.
            if n == 0 and done < req.num_tokens:
                self._watch.discard(rid)
                r.due = 0
            else:
                self._watch.add(rid)
            return
        # Decoding: one token a step from here on. Its next block fills in the
        # step in which `done` reaches the block's end.
        self._watch.discard(rid)
        step = self.step + max(1, (r.stored + 1) * bs - done) if full >= done // bs else self.step + 1
        if self.decode_every != 1:
            step = self._decode_due(step)
            if not step:
                r.due = 0  # prompt blocks only: nothing more to store
                return
        r.due = step
        d = self._due.get(step)
        if d is None:
            self._due[step] = [rid]
        else:
            d.append(rid)

    def _check_groups(self, rid: str, nst: dict, resolve: Callable, meta: RingsideConnectorMetadata) -> None:
        """_check for several KV cache groups: each group's blocks that fill
        in this step, but vLLM's null blocks, under the group's digests."""
        r = self.reqs.get(rid)
        if r is None:
            self._watch.discard(rid)
            return
        req = r.request
        n = nst.get(rid, 0)
        done = req.num_computed_tokens + n  # tokens whose KV exists after this step
        hashes = req.block_hashes
        nh = len(hashes)
        cur = r.gstored
        if cur is None:
            cur = r.gstored = [0] * len(self.groups)
        tables = self.group_tables
        got: Any = None
        mine = self.mine
        caught = True  # every group planned up to the last full block
        nxt = 0  # tokens until the next block of some group fills
        for j, g in enumerate(self.groups):
            bs = g.block_size
            full = min(done // bs, nh // g.ratio)
            a = cur[j]
            if full > a:
                if tables is not None:
                    blks = tables[j].get(rid) or ()
                    full = min(full, len(blks))
                    ids = [(i, blks[i].block_id) for i in range(a, full) if not blks[i].is_null]
                else:
                    if got is None:
                        try:
                            got = resolve(rid) or ()
                        except (KeyError, IndexError, AttributeError):  # no blocks (freed): nothing to store
                            got = ()
                    blocks = got[g.gid] if g.gid < len(got) else ()
                    full = min(full, len(blocks))
                    null = self.null_id
                    ids = [(i, blocks[i]) for i in range(a, full) if blocks[i] != null]
                if ids:
                    digs = [g.digest(hashes, i) for i, _ in ids]
                    meta.store_block_ids.extend(b for _, b in ids)
                    meta.store_digests.append(b"".join(digs))
                    if mine is not None:
                        mine.update(digs)
                    if r.store_step != self.step:  # once a step, whatever its groups
                        meta.store_req_ids.append(rid)
                    r.store_step = self.step
                    if self.runs is not None and g is self.lead:  # KV events describe the lead group
                        self.runs.append((req, ids[0][0], ids[-1][0] + 1))
                if full > a:
                    cur[j] = a = full
            if a < done // bs:
                caught = False
            left = (a + 1) * bs - done
            nxt = left if not j or left < nxt else nxt
        if self.every_step:
            return
        if n == 0 or done < req.num_tokens:
            if n == 0 and done < req.num_tokens:
                self._watch.discard(rid)
                r.due = 0
            else:
                self._watch.add(rid)
            return
        self._watch.discard(rid)
        step = self.step + max(1, nxt) if caught else self.step + 1
        r.due = step
        d = self._due.get(step)
        if d is None:
            self._due[step] = [rid]
        else:
            d.append(rid)

    def _prompt_only(self, req: Any, full: int) -> int:
        """decode_every 0: no block past the prompt's last full one."""
        p = req.num_prompt_tokens // self.block_size
        return full if full <= p else p

    def _decode_due(self, step: int) -> int:
        """The step in which a decoding request's next block is checked, for
        decode_every != 1: the next multiple of decode_every (the blocks
        filled since are stored together), or 0 (never: prompt blocks only)."""
        k = self.decode_every
        return -(-step // k) * k if k else 0

    def _legacy_blocks(self, so: "SchedulerOutput") -> Callable:
        """Block ids from the scheduler output's block lists, for vLLM
        versions without SchedulerOutput.kv_connector_block_state."""
        blocks = self._legacy
        for nr in so.scheduled_new_reqs:
            if nr.block_ids:
                blocks[nr.req_id] = [list(g) for g in nr.block_ids]
        cached = so.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            nb = cached.new_block_ids[i]
            if nb:
                if rid in resumed or rid not in blocks:
                    blocks[rid] = [list(g) for g in nb]
                else:
                    for have, new in zip(blocks[rid], nb):
                        have.extend(new)
        return lambda rid: tuple(blocks.get(rid, ([],)))
