"""The vLLM connector with several KV cache groups (vLLM's hybrid memory
allocator): a sliding-window group beside a full-attention one, driven by
vLLM's own Scheduler (HybridKVCacheCoordinator, SlidingWindowManager,
chunked prefill, preemption) and a real sidecar (vllm_harness.Engine).

Every step checks that each scheduled request's blocks before its first
scheduled token hold its tokens' bytes in every group's layers (the layers
of each group are written with values of their own, so a block of one group
loaded into another would fail the check), that the blocks a sliding window
needs are there, and that vLLM's null block is never written.
"""

import pytest
import vllm_harness as H  # skips this module where vLLM is not importable

from ringside.plugin.config import VLLM, Config
from ringside.vllm import RingsideConnector
from ringside.vllm.engine import namespace
from ringside.vllm.groups import FULL, SLIDING, Group, Layout, group_mask, layout_of, longest_hit
from ringside.vllm.hybrid import known

NOWHERE = "/dev/shm/rs-unit-no-sidecar/ringside.sock"
WINDOW = 32  # tokens: two blocks of 16
HYBRID = [WINDOW, "full"]  # group 0: sliding window (layers 0, 2); group 1: full attention (layers 1, 3)


@pytest.fixture
def sc(start_sidecar):
    return start_sidecar(metrics=True)


def window_blocks(hit_tokens: int) -> int:
    """Blocks of a window of WINDOW tokens that a hit of hit_tokens loads
    (vLLM: the blocks with a token inside the window of the next token)."""
    first = max(0, hit_tokens - WINDOW + 1) // H.BLOCK
    return hit_tokens // H.BLOCK - first


def limit(r) -> int:
    """The longest hit of a request's prompt, in blocks."""
    return (r.num_prompt_tokens - 1) // H.BLOCK


# -- the layout (pure) ---------------------------------------------------------------


def test_layout_of_a_hybrid_model():
    vc = H.vllm_config({})
    lay = layout_of(vc, H.kv_cache_config(8, HYBRID))
    assert not lay.refusal and not lay.plain
    sw, full = lay.groups
    assert (sw.kind, sw.window, full.kind) == (SLIDING, WINDOW, FULL)
    assert lay.order == (1, 0), "full attention is looked up first"
    assert full.mask == 0 and sw.mask == group_mask(0), "the lead group keeps vLLM's hashes"
    part = lay.fingerprint_part()
    assert part.startswith("sliding16w32x2+full16x2.h16.")
    # The groups are part of the namespace; one full-attention group keeps
    # the fingerprint it always had.
    _, plain_fp, _ = namespace(vc)
    _, single_fp, _ = namespace(vc, layout_of(vc, H.kv_cache_config(8)))
    _, hybrid_fp, _ = namespace(vc, lay)
    assert single_fp == plain_fp and "groups=" not in plain_fp
    assert hybrid_fp != plain_fp and "groups=" + part in hybrid_fp
    # Another group layout of the same model: another namespace.
    other = layout_of(vc, H.kv_cache_config(8, ["full", WINDOW]))
    assert namespace(vc, other)[1] != hybrid_fp


def test_group_digests_are_disjoint():
    lay = layout_of(H.vllm_config({}), H.kv_cache_config(8, [WINDOW, "full", 64]))
    hashes = H.request("d", H.prompt(1, 200)).block_hashes
    seen = {}
    for j, g in enumerate(lay.groups):
        for i in range(len(hashes)):
            d = g.digest(hashes, i)
            assert len(d) == 32 and d not in seen, (j, i, seen.get(d))
            seen[d] = (j, i)
    assert lay.groups[1].digests(hashes, 0, 3) == list(hashes[:3])


@pytest.mark.parametrize("window", [16, 17, 31, 32, 33, 64])
def test_first_needed_is_vllms_window(window):
    """The blocks a sliding window needs at a hit are those vLLM's
    SlidingWindowManager keeps (get_num_skipped_tokens)."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    spec = H.SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=H.torch.float32, sliding_window=window)
    g = Group(0, SLIDING, 16, window)
    for tokens in range(0, 400, 16):
        skipped = SlidingWindowManager.get_num_skipped_tokens(
            type("M", (), {"sliding_window": spec.sliding_window, "extra_retained_tokens": 0})(), tokens
        )
        assert g.first_needed(tokens) == skipped // 16, (window, tokens)


def oracle(present):
    """probe over sets of present block indices, one per group."""

    def probe(j, lo, hi):
        n = 0
        while lo + n < hi and lo + n in present[j]:
            n += 1
        return n

    return probe


TWO = Layout([Group(0, FULL, 16), Group(1, SLIDING, 16, 32)], 16, 16)


@pytest.mark.parametrize(
    "present, limit_blocks, want_blocks",
    [
        ([range(10), range(10)], 10, 10),  # everything
        ([range(10), range(8, 10)], 10, 10),  # the window alone is enough
        ([range(10), range(0, 8)], 10, 8),  # window [8, 10) missing: the hit ends where it is present
        ([range(6), range(10)], 10, 6),  # full attention bounds it
        ([range(10), {0, 1, 2, 3, 5, 7}], 10, 4),  # windows [8,10), [6,8), [4,6) miss; [2,4) is there
        ([range(10), {0, 1, 2, 3, 5, 7, 8}], 10, 9),  # [8,10) misses 9; [7,9) is there
        ([range(10), set()], 10, 0),
        ([range(10), {0}], 10, 1),  # a hit of one block needs that block only
        ([range(3), range(10)], 2, 2),  # the limit
    ],
)
def test_longest_hit(present, limit_blocks, want_blocks):
    got = longest_hit(TWO, limit_blocks * 16, oracle([set(p) for p in present]))
    assert got == want_blocks * 16


def test_longest_hit_gives_up_when_a_probe_cannot_answer():
    assert longest_hit(TWO, 160, lambda j, lo, hi: -1) == -1


@pytest.mark.parametrize(
    "w, lo, hi, want",
    [
        (None, 0, 4, -1),
        ([0, 8, -1], 0, 4, -1),  # not answered yet
        ([0, 8, 8], 2, 6, 4),  # all present
        ([0, 8, 5], 2, 8, 3),  # present up to the miss at 5
        ([0, 8, 5], 5, 7, 0),  # starts at the miss
        ([0, 8, 5], 6, 8, -1),  # past the miss: unknown
        ([4, 8, 4], 2, 6, -1),  # outside the batch
    ],
)
def test_known(w, lo, hi, want):
    assert known(w, lo, hi) == want


def test_refused_group_kinds():
    """A mamba group: the connector names the reason and serves nothing."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    kcc = H.kv_cache_config(8, ["full"])
    mamba = MambaSpec(block_size=16, shapes=((3, 64), (4, 8, 8)), dtypes=(H.torch.float32, H.torch.float32))
    kcc = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.mixer"], mamba)] + list(kcc.kv_cache_groups),
    )
    vc = H.vllm_config({"socket": NOWHERE})
    for role in (H.KVConnectorRole.SCHEDULER, H.KVConnectorRole.WORKER):
        c = RingsideConnector(vc, role, kcc)
        assert "group 0" in c.refused and "MambaSpec" in c.refused and "state-space" in c.refused, c.refused
        assert c.link is None
    assert c.get_transfer_results(set()).finished_recving == set()
    s = RingsideConnector(vc, H.KVConnectorRole.SCHEDULER, kcc)
    r = H.request("m", H.prompt(3, 100))
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)


# -- the store planner (no sidecar) ------------------------------------------------------------


class GroupPlanLog:
    """on_meta hook: every planned store of every group, checked against
    vLLM's block table of its group at the moment it is planned."""

    def __init__(self, eng, reqs, drop=None):
        self.eng = eng
        self.reqs = reqs
        self.lay = eng.conn.layout
        self.drop = drop  # (group, block index) -> True: take that store out (as if it had been evicted)
        self.planned: dict = {}  # (request id, group) -> [block index]

    def __call__(self, so, meta):
        where: dict = {}  # digest -> [(request id, group, block index)] (requests may share a prefix)
        for r in self.reqs:
            if r.request_id not in self.eng.sched.requests:
                continue
            for j, g in enumerate(self.lay.groups):
                for i in range(len(r.block_hashes)):
                    where.setdefault(g.digest(r.block_hashes, i), []).append((r.request_id, j, i))
        ids = iter(meta.store_block_ids)
        keep_d, keep_b = [], []
        for run in meta.store_digests:
            for k in range(0, len(run), 32):
                d = run[k : k + 32]
                blk = next(ids)
                assert blk != self.eng.null_id, "a null block was planned for storing"
                owners = [
                    (rid, j, i)
                    for rid, j, i in where[d]
                    if self.eng._block_ids(rid, self.lay.groups[j].gid)[i : i + 1] == [blk]
                ]
                assert owners, "digest planned as engine block %d, which no request holds there: %s" % (blk, where[d])
                rid, j, i = owners[0]
                self.planned.setdefault((rid, j), []).append(i)
                if self.drop is None or not self.drop(j, i):
                    keep_d.append(d)
                    keep_b.append(blk)
        assert next(ids, None) is None, "more block ids than digests"
        if self.drop is not None:
            meta.store_digests[:] = [b"".join(keep_d)] if keep_d else []
            meta.store_block_ids[:] = keep_b


def test_store_planner_every_group_every_block_once():
    """Chunked prefill, decoding and preemption: every block of every group
    is planned once, in the step it fills, from the group's own block table
    under the group's digest; a sliding window's blocks are all stored (as
    vLLM caches them), but never a null block."""
    eng = H.Engine(NOWHERE, num_blocks=40, max_num_batched_tokens=32, groups=HYBRID)
    reqs = [H.request("r%d" % i, H.prompt(i, n), max_tokens=40) for i, n in enumerate((50, 70, 90, 110))]
    log = GroupPlanLog(eng, reqs)
    eng.run(reqs, on_meta=log)
    assert eng.stats["resumed"] > 0, "nothing was preempted: %s" % eng.stats
    for r in reqs:
        for j in range(2):
            got = log.planned.get((r.request_id, j), [])
            assert sorted(got) == list(range((r.num_tokens - 1) // H.BLOCK)), (r.request_id, j, got)
    assert not eng.sside.reqs and not eng.sside.planner._watch


# -- against a real sidecar --------------------------------------------------------------------


def prompts(tag, n=3, prefix_len=60, length=150, max_tokens=12):
    prefix = H.prompt(99, prefix_len)
    return [H.request("%s%d" % (tag, i), H.prompt(i, length, prefix), max_tokens=max_tokens) for i in range(n)]


@pytest.mark.parametrize("mirror", [True, False], ids=["local-index", "sidecar-lookups"])
def test_hybrid_hits_load_only_the_window(sc, mirror):
    """What one engine stored is a hit for the next: every full-attention
    block of the hit and, of the sliding window, only the blocks inside the
    window at the hit; the blocks hold the right bytes in every group."""
    extra = {"mirror": mirror, "mirror_idle_ms": 60000, "mirror_max_lag_ms": 60000}
    a = H.Engine(sc.sock, extra=extra, groups=HYBRID)
    a.run(prompts("a"))
    a.shutdown()
    assert a.wstats["stored_blocks"] > 0 and a.wstats["store_errors"] == 0, a.wstats
    b = H.Engine(sc.sock, extra=extra, groups=HYBRID)
    reqs = prompts("b")
    b.run(reqs)
    b.shutdown()
    st, ws = b.stats, b.wstats
    hits = [limit(r) for r in reqs]
    assert st["hit_blocks"] == sum(hits), st
    want = sum(h + window_blocks(h * H.BLOCK) for h in hits)
    assert ws["loaded_blocks"] == want and ws["load_error_blocks"] == 0, (ws, want)
    assert st["load_blocks_window"] == sum(window_blocks(h * H.BLOCK) for h in hits) == 2 * len(reqs), st
    assert st["mirror_lookups"] == (len(reqs) if mirror else 0), st
    assert st["sidecar_errors"] == ws["sidecar_errors"] == 0
    assert b.checked_blocks > 0
    assert sc.state()["pool"]["Leases"] == 0


def test_next_turn_asks_about_its_window(sc):
    """A conversation's next turn (prompt + output + more): the full-attention
    hit ends where the first turn's KV did, short of the longest possible
    hit the window was asked about at arrival, so the window at the actual
    hit is asked about then (window_probes) and loaded."""
    a = H.Engine(sc.sock, extra={"mirror": False}, groups=HYBRID)
    first = prompts("t", max_tokens=20)
    a.run(first)
    a.shutdown()
    b = H.Engine(sc.sock, extra={"mirror": False}, groups=HYBRID)
    turn = [
        H.request("u%d" % i, list(r.all_token_ids) + H.prompt(7 + i, 40), max_tokens=4) for i, r in enumerate(first)
    ]
    b.run(turn)
    b.shutdown()
    st, ws = b.stats, b.wstats
    hits = [(r.num_tokens - 1) // H.BLOCK for r in first]  # every block with KV in the first turn
    assert st["hit_blocks"] == sum(hits), (st, hits)
    assert st["window_probes"] >= len(turn), st
    assert ws["loaded_blocks"] == sum(h + window_blocks(h * H.BLOCK) for h in hits), ws
    assert ws["load_error_blocks"] == 0


def test_a_hit_needs_every_group(sc):
    """The sliding window's blocks 7 and 8 of every request were never stored
    (as if evicted): the full-attention blocks alone do not make a hit of 9
    blocks (its window is [7, 9)); the hit ends at block 7, the longest one
    whose window ([5, 7)) is there."""
    a = H.Engine(sc.sock, extra={"mirror": False}, groups=HYBRID)
    first = prompts("c")
    a.run(first, on_meta=GroupPlanLog(a, first, drop=lambda j, i: j == 0 and i in (7, 8)))
    a.shutdown()
    b = H.Engine(sc.sock, extra={"mirror": False}, groups=HYBRID)
    reqs = prompts("d")
    b.run(reqs)
    b.shutdown()
    st, ws = b.stats, b.wstats
    assert st["hit_blocks"] == 7 * len(reqs) and st["group_cut_hits"] == len(reqs), st
    assert ws["loaded_blocks"] == len(reqs) * (7 + window_blocks(7 * H.BLOCK)) and ws["load_error_blocks"] == 0, ws


def test_no_group_serves_another(sc):
    """Only the full-attention group's blocks were stored: the sidecar holds
    a block under every one of vLLM's hashes, yet nothing is a hit, since
    the sliding window's lookups are in a digest domain of their own."""
    a = H.Engine(sc.sock, extra={"mirror": False}, groups=HYBRID)
    first = prompts("e")
    a.run(first, on_meta=GroupPlanLog(a, first, drop=lambda j, i: j == 0))
    a.shutdown()
    pool = sc.state()["pool"]
    assert pool["Blocks"] == len({h for r in first for h in r.block_hashes[: (r.num_tokens - 1) // H.BLOCK]}), pool
    b = H.Engine(sc.sock, extra={"mirror": False}, groups=HYBRID)
    b.run(prompts("f"))
    b.shutdown()
    assert b.stats["hit_blocks"] == 0 and b.wstats["loaded_blocks"] == 0, (b.stats, b.wstats)


@pytest.mark.parametrize("first, second", [(None, HYBRID), (HYBRID, None), (HYBRID, ["full", WINDOW])])
def test_group_layouts_share_no_block(sc, first, second):
    """The same model with another group layout (the hybrid allocator off,
    or groups in another order) attaches to another namespace: no hit."""
    a = H.Engine(sc.sock, groups=first)
    a.run(prompts("g"))
    a.shutdown()
    assert a.wstats["stored_blocks"] > 0
    b = H.Engine(sc.sock, groups=second)
    b.run(prompts("h"))
    b.shutdown()
    assert b.stats["hit_blocks"] == 0 and b.wstats["loaded_blocks"] == 0, b.stats
    assert b.wstats["stored_blocks"] > 0
    assert sc.state()["pool"]["Namespaces"] == 2  # both engines gone; each namespace kept its blocks
    assert sc.state()["pool"]["Blocks"] == a.wstats["stored_blocks"] + b.wstats["stored_blocks"]


def test_a_failed_group_load_recomputes_the_request(sc):
    """A lease that does not cover one group's blocks fails the whole load:
    the workers report the request in failed_recving (never block ids, which
    vLLM refuses for several groups) and vLLM recomputes it."""
    a = H.Engine(sc.sock, extra={"mirror": False}, groups=HYBRID)
    a.run(prompts("i"))
    a.shutdown()
    b = H.Engine(sc.sock, extra={"mirror": False}, groups=HYBRID)
    failed = []

    def break_first_load(so, meta):
        for spec in meta.loads:
            if spec.more and not failed:
                failed.append(spec.req_id)
                spec.error_block_ids, spec.block_ids, spec.more, spec.lease = list(spec.block_ids), [], [], 0

    reqs = prompts("j")
    b.run(reqs, on_meta=break_first_load)
    b.shutdown()
    assert failed and b.wstats["load_error_blocks"] > 0, b.wstats
    assert set(b.outputs) == {r.request_id for r in reqs}
    assert all(len(b.outputs[r.request_id]) == 12 for r in reqs)
    assert sc.state()["pool"]["Leases"] == 0


def test_every_layer_a_sliding_window(sc):
    """A model whose only group is a sliding window (Mistral 7B v0.1 style):
    not the plain layout (vLLM pads its block table with null blocks); a
    hit loads the window's blocks only, none is stored from a null block."""
    a = H.Engine(sc.sock, extra={"mirror": False}, groups=[WINDOW])
    assert not a.conn.layout.plain and a.conn.layout.fingerprint_part().startswith("sliding16w32x2.")
    first = prompts("k")
    a.run(first, on_meta=GroupPlanLog(a, first))
    a.shutdown()
    b = H.Engine(sc.sock, extra={"mirror": False}, groups=[WINDOW])
    reqs = prompts("l")
    b.run(reqs)
    b.shutdown()
    hits = [limit(r) for r in reqs]
    assert b.stats["hit_blocks"] == sum(hits), b.stats
    assert b.wstats["loaded_blocks"] == sum(window_blocks(h * H.BLOCK) for h in hits), b.wstats


@pytest.mark.parametrize("runner", ["v2", "v2-zeroing", "v1"])
def test_a_window_waits_for_stores_only_where_it_hands_their_blocks_on(sc, runner):
    """A sliding window frees a live request's blocks (vLLM's null block in
    their place) as its tokens leave the window, and a schedule may hand
    them on at once. The workers wait for the stores that read them before
    any write of a step (StoreGuard checks every write: the forward pass's,
    and Model Runner V2's zeroing before handle_preemptions where the model
    needs it), but only then: a step whose stores no schedule hands on lets
    them run on, so a window model's stores are not synchronous."""
    from test_vllm_connector import StoreGuard, zero_new_blocks

    eng = H.Engine(sc.sock, num_blocks=14, max_num_batched_tokens=64, groups=HYBRID, extra={"overlap_saves": True})
    if runner == "v2-zeroing":
        zero_new_blocks(eng)
    eng.worker.connector_worker.writes_first = runner != "v1"
    g = StoreGuard(eng)
    reqs = [H.request("w%d" % i, H.prompt(30 + i, 47 + 3 * i), max_tokens=30) for i in range(5)]
    eng.run(reqs, on_meta=g.on_meta)
    eng.shutdown()
    assert eng.wstats["store_errors"] == 0 and eng.wstats["stored_blocks"] > 0, eng.wstats
    assert g.checked >= eng.steps
    assert g.handed > 0, "no schedule handed on a block the step before stored"
    with_stores = sum(1 for m in eng.metas if m.store_block_ids)
    if runner != "v2-zeroing":
        # Each wait is one a hand-on made (its step's handle_preemptions).
        assert 0 < g.blocked <= g.handed < with_stores, (g.blocked, g.handed, with_stores)


def test_kv_events_describe_the_lead_group_only():
    """KV events with several groups: the planner's runs for descriptions are
    the lead (full-attention, unmasked) group's blocks, each once, as
    contiguous ranges; the sliding window's blocks are never described, and
    the events carry the lead group's group_idx and kind."""
    from ringside.vllm import events as E

    eng = H.Engine(NOWHERE, num_blocks=40, max_num_batched_tokens=32, groups=HYBRID)
    lay = eng.conn.layout
    lead = E.lead_group(lay)
    assert lead is not None and lead.kind == "full" and not lead.mask
    assert [g.gid for g in lay.groups if g.kind == "full"] == [lead.gid]
    reqs = [H.request("e%d" % i, H.prompt(i, n), max_tokens=40) for i, n in enumerate((50, 70, 90, 110))]
    log = GroupPlanLog(eng, reqs)
    runs: dict = {}

    class Noted:  # what the scheduler hands KV events each step (KVEvents.note)
        def note(self, got):
            for req, a, b in got:
                assert a < b
                runs.setdefault(req.request_id, []).extend(range(a, b))

        def take_events(self, session, faults):
            return []

    eng.sside.events = Noted()
    eng.sside.planner.runs = []
    eng.run(reqs, on_meta=log)
    eng.sside.events = None
    j = [g.gid for g in lay.groups].index(lead.gid)
    for r in reqs:
        assert runs[r.request_id] == sorted(log.planned[(r.request_id, j)]), r.request_id
    ev = E.KVEvents(Config.parse({}, VLLM), H.BLOCK, eng.kv_cache_config, lay)
    assert ev.gid == lead.gid and ev.block_size == lead.block_size and ev.kind == "full_attention"


def test_the_order_within_a_block_is_part_of_the_namespace():
    """Two engines whose attention backends order a layer's block
    differently (tokens then heads, NHC; heads then tokens, HNC) hold other
    bytes under one block hash: never the same namespace. A block-outermost
    layout keeps a block's bytes (a page is its layers in index order), so
    it shares the layer-outermost one's namespace."""
    vc = H.vllm_config({})
    fps = {}
    for name in ("LBNHC", "BLNHC", "LBHNC", None):
        kcc = H.kv_cache_config(8)
        kcc.kv_cache_layout = name
        fps[name] = namespace(vc, None, kcc)[1]
    assert fps["LBNHC"] == fps["BLNHC"] != fps["LBHNC"]
    assert "within=NHC" in fps["LBNHC"] and "within=HNC" in fps["LBHNC"]
    # Unresolved (no layout recorded): its own namespace, never NHC's by guess.
    assert fps[None] not in (fps["LBNHC"], fps["LBHNC"])
