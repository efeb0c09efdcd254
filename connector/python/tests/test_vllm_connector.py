"""Unit tests of the vLLM connector's pieces, driven by vLLM's own classes.

vLLM's Scheduler (its Request, block hashing, KV cache manager, chunked
prefill, preemption, SchedulerOutput) drives the connector; the worker side
runs on real KV tensors against a real sidecar where a piece talks to one
(vllm_harness.Engine). Every step checks that each scheduled request's blocks
before its first scheduled token hold the bytes of its tokens, whether
computed, prefix-cached or loaded from the sidecar. Seconds, not minutes:
no model, no engine process.
"""

import os
import signal
import time

import pytest
import vllm_harness as H  # skips this module where vLLM is not importable

from ringside import schema as S
from ringside.plugin.config import ConfigError
from ringside.sidecar_process import stop_process
from ringside.vllm import RingsideConnector
from ringside.vllm.loads import Load, LoadState

NOWHERE = "/dev/shm/rs-unit-no-sidecar/ringside.sock"


@pytest.fixture
def sc(start_sidecar):
    return start_sidecar(metrics=True)


def full_blocks(tokens: int) -> int:
    """Blocks whose KV exists once a request of this many tokens finished
    (its last sampled token is never fed)."""
    return (tokens - 1) // H.BLOCK


class PlanLog:
    """on_meta hook: every planned store, checked against vLLM's block table
    at the moment it is planned."""

    def __init__(self, eng: H.Engine, reqs):
        self.eng = eng
        self.where = {}  # digest -> (request id, block index)
        self.reqs = reqs
        self.planned: dict = {}  # request id -> [block index]
        # (the schedule handed on a block the last step's stores read?, wait_saves) a step
        self.wait_saves = []
        self.last: set = set()  # the block ids the last step's stores read

    def __call__(self, so, meta):
        for r in self.reqs:  # block hashes grow as tokens are added
            for i, h in enumerate(r.block_hashes):
                self.where.setdefault(h, (r.request_id, i))
        ids = iter(meta.store_block_ids)
        for run in meta.store_digests:
            for k in range(0, len(run), 32):
                rid, i = self.where[run[k : k + 32]]
                blk = next(ids)
                table = self.eng._block_ids(rid)
                assert table[i] == blk, "block %d of %s planned as engine block %d, holds %d" % (i, rid, blk, table[i])
                self.planned.setdefault(rid, []).append(i)
        assert next(ids, None) is None, "more block ids than digests"
        # The blocks this schedule allocated: a new request's, those added
        # to a scheduled one (all of a resumed one's), in every group.
        new = {b for nr in so.scheduled_new_reqs for g in nr.block_ids for b in g}
        new |= {b for nb in so.scheduled_cached_reqs.new_block_ids if nb for g in nb for b in g}
        self.wait_saves.append((bool(self.last & new), meta.wait_saves))
        self.last = set(meta.store_block_ids)


def check_plan(log: PlanLog, reqs, eng: H.Engine) -> None:
    for r in reqs:
        got = log.planned.get(r.request_id, [])
        assert sorted(got) == list(range(full_blocks(r.num_tokens))), (r.request_id, got, r.num_tokens)
    assert eng.stats["planned_blocks"] == sum(full_blocks(r.num_tokens) for r in reqs)
    for reused, wait in log.wait_saves:
        assert wait or not reused, "a step that handed on a block the last step's stores read let them run on"
        assert reused or not wait, "a step that handed on no block the last step's stores read waited for them"


# -- configuration --------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"max_wait_usec": 50}, ["'max_wait_usec'", "did you mean 'max_wait_us'?"]),
        ({"mirorr": False}, ["'mirorr'", "did you mean 'mirror'?"]),
        ({"timeout": "fast"}, ["'timeout'", '"fast"', "a number of seconds > 0"]),
        ({"timeout": 0}, ["'timeout'", "0", "> 0"]),
        ({"mirror": "maybe"}, ["'mirror'", '"maybe"', "true or false"]),
        ({"overlap_saves": "sometimes"}, ["'overlap_saves'", '"auto", true or false']),
        ({"stats_every": 2.5}, ["'stats_every'", "2.5", "an integer of steps >= 1"]),
        ({"max_batches": 8}, ["'max_batches'", "read by the SGLang backend only"]),
    ],
)
def test_config_errors_name_the_key(extra, words):
    vc = H.vllm_config(extra)
    with pytest.raises(ConfigError) as e:
        RingsideConnector(vc, H.KVConnectorRole.WORKER, H.kv_cache_config(8))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_config_error_fails_the_engine_start():
    with pytest.raises(ConfigError, match="'max_wait_usec'.*'max_wait_us'"):
        H.Engine(NOWHERE, extra={"max_wait_usec": 50})


def test_config_values_reach_the_sides():
    eng = H.Engine(NOWHERE, extra={"max_wait_us": 250, "mirror": "false", "overlap_saves": True, "stats_every": 3})
    s = eng.sside
    assert s.budget.max_ns == 250_000 and s.index is None and eng.conn.mirror is None
    assert eng.worker.connector_worker.overlap_saves() is True
    assert s.stats_file.every == 3


# -- the store planner (no sidecar: pure) ------------------------------------------


def test_store_planner_chunked_prefill_and_decode():
    """Every block with KV is planned once, in the step it fills, with vLLM's
    digest and the engine block that holds it: prompt blocks filled by
    64-token chunks and blocks filled by decoding alike."""
    eng = H.Engine(NOWHERE, max_num_batched_tokens=32)
    reqs = [H.request("r%d" % i, H.prompt(i, n), max_tokens=40) for i, n in enumerate((50, 70, 90))]
    log = PlanLog(eng, reqs)
    eng.run(reqs, on_meta=log)
    check_plan(log, reqs, eng)
    planner = eng.sside.planner
    assert not planner._watch and not eng.sside.reqs, "finished requests left state behind"
    assert eng.stats["sidecar_errors"] == 0 and eng.stats["lookups"] == 0  # no sidecar: nothing asked


@pytest.mark.parametrize("every", [0, 4])
def test_store_planner_decode_every(every):
    """store_decode_every: 0 plans every full prompt block and no block that
    decoding fills; 4 plans decode blocks only in steps that are multiples
    of 4 (each once, in order; at most the block filled in the last three
    steps before a request finishes is left out)."""
    eng = H.Engine(NOWHERE, max_num_batched_tokens=32, extra={"store_decode_every": every})
    reqs = [H.request("d%d" % i, H.prompt(20 + i, n), max_tokens=60) for i, n in enumerate((50, 70, 90))]
    log = PlanLog(eng, reqs)
    steps = {}  # request id -> [(step, block index)]

    def on_meta(so, meta):
        before = {rid: len(v) for rid, v in log.planned.items()}
        log(so, meta)
        for rid, v in log.planned.items():
            steps.setdefault(rid, []).extend((eng.sside.planner.step, i) for i in v[before.get(rid, 0) :])

    eng.run(reqs, on_meta=on_meta)
    for r in reqs:
        got = log.planned.get(r.request_id, [])
        prompt_blocks = r.num_prompt_tokens // H.BLOCK
        assert got == list(range(len(got))), (r.request_id, got)  # each once, in order
        if every == 0:
            assert len(got) == prompt_blocks, (r.request_id, got)
            continue
        assert full_blocks(r.num_tokens) - 1 <= len(got) <= full_blocks(r.num_tokens), (r.request_id, got)
        decode = [s for s, i in steps[r.request_id] if i >= prompt_blocks]
        assert decode and all(s % every == 0 for s in decode), (r.request_id, steps[r.request_id])
    assert not eng.sside.planner._watch and not eng.sside.reqs


def test_store_planner_preemption_and_resumption():
    """Too few KV blocks for four growing requests: vLLM preempts and resumes
    them; the cursors survive, every block is still planned exactly once,
    and the workers wait for the last step's stores exactly in the steps
    whose schedule hands on a block they read (freed by a preemption)."""
    eng = H.Engine(NOWHERE, num_blocks=14, max_num_batched_tokens=64)
    reqs = [H.request("p%d" % i, H.prompt(10 + i, 40 + 3 * i), max_tokens=50) for i in range(4)]
    log = PlanLog(eng, reqs)
    eng.run(reqs, on_meta=log)
    assert eng.stats["resumed"] > 0, "nothing was preempted: %s" % eng.stats
    check_plan(log, reqs, eng)


# -- the load state machine (pure) -------------------------------------------------


def lease(status=S.Status.OK, state=S.State.READY, lease_id=7, blocks=3):
    return S.LeaseReply(status, state, lease_id, blocks, "")


@pytest.mark.parametrize(
    "replies, want_state, want_spec",
    [
        ([lease()], LoadState.READY, (7, [10, 11, 12], [])),
        ([lease(state=S.State.LOADED)], LoadState.READY, (7, [10, 11, 12], [])),
        ([lease(blocks=2)], LoadState.READY, (7, [10, 11], [12])),  # the lease covers less than the hit
        ([lease(state=S.State.WAITING)], LoadState.WAITING, None),
        ([lease(state=S.State.WAITING), lease(state=S.State.READY)], LoadState.READY, (7, [10, 11, 12], [])),
        # A lease that waited for the shared tier's fetch holds what the
        # poll that says ready counts, which may be fewer than promised.
        ([lease(state=S.State.WAITING), lease(state=S.State.READY, blocks=1)], LoadState.READY,
         (7, [10], [11, 12])),
        ([lease(state=S.State.WAITING), lease(state=S.State.MISS)], LoadState.FAILED, (0, [], [10, 11, 12])),
        ([lease(status=S.Status.UNKNOWN_BATCH)], LoadState.FAILED, (0, [], [10, 11, 12])),
        ([lease(state=S.State.MISS)], LoadState.FAILED, (0, [], [10, 11, 12])),
        ([None], LoadState.FAILED, (0, [], [10, 11, 12])),  # no reply in time, or undecodable
    ],
)  # fmt: skip
def test_load_state_machine(replies, want_state, want_spec):
    ld = Load([10, 11, 12])
    assert ld.state == LoadState.UNSENT
    ld.acquiring(41, 1, 0.0)
    assert ld.state == LoadState.ACQUIRING and ld.seq == 41
    for i, rep in enumerate(replies):
        if i:
            ld.polling(42 + i, 0.0)
        ld.on_reply(rep)
        assert ld.seq == 0
    assert ld.state == want_state
    if want_spec is not None:
        spec = ld.spec("r")
        assert (spec.lease, spec.block_ids, spec.error_block_ids) == want_spec


def test_load_never_sent_is_all_errors():
    ld = Load([5, 6])
    ld.fail()
    spec = ld.spec("r")
    assert (spec.lease, spec.block_ids, spec.error_block_ids) == (0, [], [5, 6])


# -- admission and loads, against a real sidecar --------------------------------------


def shared_prompts(tag, n=3, prefix_len=40, length=70):
    prefix = H.prompt(99, prefix_len)
    return [H.request("%s%d" % (tag, i), H.prompt(i, length, prefix)) for i in range(n)]


@pytest.mark.parametrize("mirror", [True, False], ids=["local-index", "sidecar-lookups"])
def test_hits_in_a_second_engine(sc, mirror):
    """What one engine stored is found and loaded by the next (a restart):
    through the local index, or through sidecar lookups; the loaded blocks
    hold the bytes of the tokens; no lease is left."""
    # The index, when on, is trusted for a minute (a loaded machine cannot
    # make it fall back to the sidecar).
    extra = {"mirror": mirror, "mirror_idle_ms": 60000, "mirror_max_lag_ms": 60000}
    a = H.Engine(sc.sock, extra=extra)
    a.run(shared_prompts("a"))
    a.shutdown()
    assert a.wstats["stored_blocks"] == 2 + 3 * 2 and a.wstats["store_errors"] == 0, a.wstats
    b = H.Engine(sc.sock, extra=extra)
    reqs = shared_prompts("b")
    b.run(reqs)
    b.shutdown()
    hits = sum(min(len(r.block_hashes), (r.num_prompt_tokens - 1) // H.BLOCK) for r in reqs)
    st, ws = b.stats, b.wstats
    assert st["hit_blocks"] == hits == 12, st
    assert st["mirror_lookups"] == (3 if mirror else 0), st
    assert ws["loaded_blocks"] == hits and ws["load_error_blocks"] == 0, ws
    assert st["sidecar_errors"] == ws["sidecar_errors"] == 0
    assert b.checked_blocks > 0
    assert sc.state()["pool"]["Leases"] == 0


def test_chunked_prefill_preemption_then_every_block_hits(sc):
    """An engine short of KV blocks prefills in chunks and preempts; the next
    turn of each conversation (prompt + output) finds every block that had
    KV in the first one, decoded blocks included."""
    a = H.Engine(sc.sock, num_blocks=14, max_num_batched_tokens=32)
    first = [H.request("t%d" % i, H.prompt(20 + i, 40 + 5 * i), max_tokens=40) for i in range(4)]
    a.run(first)
    a.shutdown()
    assert a.stats["resumed"] > 0, a.stats
    assert a.wstats["store_errors"] == 0
    b = H.Engine(sc.sock, num_blocks=64)
    turn = [H.request("u%d" % i, list(r.all_token_ids), max_tokens=4) for i, r in enumerate(first)]
    b.run(turn)
    b.shutdown()
    want = sum(full_blocks(r.num_tokens) for r in first)
    assert b.stats["hit_blocks"] == want and b.wstats["loaded_blocks"] == want, (b.stats, b.wstats)
    assert b.wstats["load_error_blocks"] == 0


def test_resumed_request_is_looked_up_again(sc):
    """A request preempted while it decodes is looked up afresh when it comes
    back: its own blocks, stored meanwhile, are hits (counted once a
    resumption, not once a step it waits)."""
    eng = H.Engine(sc.sock, num_blocks=14, max_num_batched_tokens=64, extra={"mirror": False})
    reqs = [H.request("q%d" % i, H.prompt(30 + i, 40 + 3 * i), max_tokens=50) for i in range(4)]
    eng.run(reqs)
    eng.shutdown()
    st = eng.stats
    assert st["resumed"] > 0, st
    assert st["hit_blocks"] > 0, "no resumed request found its own stored blocks: %s" % st
    assert st["lookups"] <= len(reqs) + st["resumed"], st
    # A hit vLLM's own prefix cache partly holds loads only the rest.
    assert 0 < eng.wstats["loaded_blocks"] <= st["hit_blocks"] and eng.wstats["load_error_blocks"] == 0


def wait_pool(sc, eng, key, want, timeout=20.0):
    """Step eng until the sidecar's pool counter key is want: bounded by
    wall time, not by a number of steps (a loaded machine takes longer to
    run a resumed sidecar)."""
    deadline = time.monotonic() + timeout
    while sc.state()["pool"][key] != want:
        assert time.monotonic() < deadline, "pool %s stayed %s" % (key, sc.state()["pool"][key])
        eng.step()
        time.sleep(0.005)


def step_until(eng, cond, timeout=20.0):
    """Step eng until cond() holds, bounded by wall time."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in %.0f s" % timeout
        eng.step()
        time.sleep(0.002)


# The index answers every lookup without the sidecar (fresh for a minute),
# and the scheduler does not wait for replies in a step.
FROZEN = {"max_wait_us": 0, "mirror_idle_ms": 60000, "mirror_poll_ms": 60000, "mirror_max_lag_ms": 60000}


def stored_prefix(sc):
    a = H.Engine(sc.sock)
    a.run(shared_prompts("s", n=1))
    a.shutdown()


def test_request_finished_while_acquire_in_flight(sc):
    """A request aborted after its hit was allocated, before the sidecar
    answered the acquire: the lease is released once the answer comes (no
    lease pinned until its TTL), and vLLM frees the request's blocks (the
    workers report its load finished)."""
    stored_prefix(sc)
    eng = H.Engine(sc.sock, extra=FROZEN)
    free0 = eng.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    (r,) = shared_prompts("x", n=1)
    eng.add(r)
    stop_process(sc.proc.pid)
    try:
        eng.step()
        assert r.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS
        assert eng.sside.loads.waiting, "the acquire was answered by a stopped sidecar?"
        eng.sched.finish_requests(r.request_id, H.RequestStatus.FINISHED_ABORTED)
        assert eng.sside.loads.orphans
    finally:
        os.kill(sc.proc.pid, signal.SIGCONT)
    wait_pool(sc, eng, "Leases", 0)
    # The workers report the orphan's load finished once the sidecar has
    # answered it: a step or a few, more on a loaded machine.
    step_until(eng, lambda: r.request_id not in eng.sched.requests and not eng.sside.loads.orphans)
    assert eng.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0
    assert eng.stats["sidecar_errors"] == 0 and not eng.sside.loads.orphans
    # The engine goes on serving, hits included.
    (r2,) = shared_prompts("y", n=1)
    eng.run([r2])
    assert eng.wstats["loaded_blocks"] > 0 and eng.wstats["load_error_blocks"] == 0
    eng.shutdown()


def test_request_finished_while_load_in_flight(sc):
    """A request aborted while the workers' load into its blocks is in
    flight: vLLM keeps its blocks until the load is collected, the lease is
    released, nothing is reported as an error."""
    stored_prefix(sc)
    eng = H.Engine(sc.sock, extra=FROZEN)
    (r,) = shared_prompts("z", n=1)
    eng.add(r)

    def freeze(so, meta):
        if meta.loads:
            stop_process(sc.proc.pid)

    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the acquire is answered and the load sent
            eng.step(freeze)
            if eng.worker.connector_worker._inflight:
                break
            assert not eng.metas[-1].loads, "the load was sent but is not in flight: %s" % eng.metas[-1].loads
            time.sleep(0.002)
        assert eng.worker.connector_worker._inflight, "no load in flight"
        eng.sched.finish_requests(r.request_id, H.RequestStatus.FINISHED_ABORTED)
        assert r.request_id in eng.sched.requests  # blocks kept: the load may still write them
        # Its lease is released only once the workers report the load: a
        # release sent now could reach the sidecar before the Load (another
        # session's ring) and fail it.
        assert r.request_id in eng.sside.loads.recving, "released while the load is in flight"
    finally:
        os.kill(sc.proc.pid, signal.SIGCONT)
    for _ in range(200):
        eng.step()
        if r.request_id not in eng.sched.requests:
            break
        time.sleep(0.005)
    assert r.request_id not in eng.sched.requests
    wait_pool(sc, eng, "Leases", 0)
    assert not eng.sside.loads.recving
    assert eng.wstats["load_error_blocks"] == 0 and eng.stats["sidecar_errors"] == 0
    eng.shutdown()


def finished_answers(eng: H.Engine) -> dict:
    """What the connector answers vLLM's request_finished (vLLM calls
    request_finished_all_groups), by request id: True holds the blocks."""
    got = {}
    orig = eng.conn.request_finished_all_groups

    def rec(request, block_ids):
        out = orig(request, block_ids)
        got[request.request_id] = out[0]
        return out

    eng.conn.request_finished_all_groups = rec
    return got


def test_request_finished_while_store_in_flight(sc):
    """Requests that finish in the step that planned stores of their blocks
    are held (vLLM keeps their blocks) and released by the workers once
    those stores are answered; the stores run on through the next forward
    pass (overlap_saves), since no block they read can be handed on."""
    eng = H.Engine(sc.sock, extra={"overlap_saves": True})
    held = finished_answers(eng)
    # 47 prompt tokens: blocks 0-1 fill in the prefill step, block 2 in the
    # first decode step, which is the short requests' last.
    short = [H.request("w%d" % i, H.prompt(50 + i, 47), max_tokens=2) for i in range(2)]
    long = H.request("long", H.prompt(60, 20), max_tokens=30)
    for r in short + [long]:
        eng.add(r)
    finished_at = {}
    while len(eng.finished) < 3 or len(eng.sched.requests):
        assert eng.steps < 100
        eng.step()
        for rid in eng.finished:
            finished_at.setdefault(rid, eng.steps - 1)
    eng.shutdown()
    k = finished_at["w0"]
    assert finished_at["w1"] == k and set(eng.metas[k].store_req_ids) >= {"w0", "w1"}
    assert held["w0"] is held["w1"] is True
    assert set(eng.metas[k + 1].held_req_ids) == {"w0", "w1"}
    assert not all(m.wait_saves for m in eng.metas), "no step let the stores run on"
    assert eng.wstats["saves_unwaited"] > 0 and eng.wstats["store_errors"] == 0
    assert eng.wstats["stored_blocks"] == 3 * 2 + full_blocks(long.num_tokens)


def test_request_without_store_in_flight_is_freed_at_once(sc):
    """A request whose last store was planned steps before it finished:
    nothing can still read its blocks, vLLM frees them at once."""
    eng = H.Engine(sc.sock)
    held = finished_answers(eng)
    # 33 prompt tokens and 10 more: blocks 0-1 fill in the prefill step,
    # decoding fills none.
    r = H.request("n0", H.prompt(80, 33), max_tokens=10)
    eng.run([r])
    eng.shutdown()
    assert held == {"n0": False}
    assert "n0" not in eng.sched.requests and not any(m.held_req_ids for m in eng.metas)
    assert eng.wstats["stored_blocks"] == 2


@pytest.mark.parametrize("end", ["ok", "refused", "timeout"])
def test_held_request_released_when_its_store_ends(sc, end):
    """A request finished while its store is in flight (the sidecar stopped
    before the store was sent): vLLM keeps its blocks while the store is
    unanswered, and the workers release them once the store ended: answered
    OK, refused (an error reply), or, past save_timeout, once the sidecar
    can no longer commit it: a stopped sidecar never answers the Detach, so
    the blocks stay held for the sidecar's write timeout since the store was
    sent, then are released; the engine goes on serving."""
    timeout = 1.5 if end == "timeout" else 20
    hold = 3.0
    extra = {"overlap_saves": True, "save_timeout": timeout}
    eng = H.Engine(sc.sock, extra=dict(FROZEN, **extra))
    eng.worker.connector_worker.write_timeout = hold
    held = finished_answers(eng)
    pool = eng.sched.kv_cache_manager.block_pool
    free0 = pool.get_num_free_blocks()
    # 40 prompt tokens and 9 more: blocks 0-1 fill in the prefill step (their
    # store is answered steps before), block 2 in the last step.
    r = H.request("h0", H.prompt(70, 40), max_tokens=9)
    eng.add(r)

    def freeze(so, meta):
        if not meta.store_req_ids or eng.steps == 0:
            return
        assert set(meta.store_req_ids) == {"h0"} and len(meta.store_block_ids) == 1
        if end == "refused":  # a page the region does not have: the sidecar refuses the store
            meta.store_block_ids[-1] = 1 << 20
        eng.worker.connector_worker._finish_saves()  # the earlier stores are answered: only this one waits
        stop_process(sc.proc.pid)
        sent.append(time.monotonic())

    sent: list = []  # when the store was sent (just after)
    stopped = True
    try:
        while "h0" not in eng.finished:
            assert eng.steps < 20
            eng.step(freeze)
        assert held == {"h0": True}
        t0 = time.monotonic()
        for _ in range(3):  # the store is unanswered: the blocks stay
            eng.step()
            assert "h0" in eng.sched.requests and pool.get_num_free_blocks() < free0
            assert eng.conn.has_pending_block_frees()  # vLLM waits for them rather than preempt
        assert end != "timeout" or time.monotonic() - t0 < timeout, "the steps waited for the store"
        answered = eng.wstats["stores"]
        if end != "timeout":
            os.kill(sc.proc.pid, signal.SIGCONT)
            stopped = False
        for _ in range(2000):
            eng.step()
            if "h0" not in eng.sched.requests:
                break
            time.sleep(0.005)
        assert "h0" not in eng.sched.requests, "the held request was never released"
        if end == "timeout":  # released by the bound, with the sidecar still stopped
            assert time.monotonic() - sent[0] >= hold, "released before the sidecar's write timeout"
    finally:
        if stopped:
            os.kill(sc.proc.pid, signal.SIGCONT)
    assert pool.get_num_free_blocks() == free0 and not eng.conn.has_pending_block_frees()
    ws = eng.wstats
    if end == "ok":
        assert ws["stores"] == answered + 1 and ws["store_errors"] == 0 and ws["stored_blocks"] == 3, ws
    elif end == "refused":
        assert ws["stores"] == answered + 1 and ws["store_errors"] == 1 and ws["sidecar_errors"] == 0, ws
    else:
        assert ws["stores"] == answered and ws["store_errors"] == 1 and ws["sidecar_errors"] >= 1, ws
    # The engine goes on serving (a new session after a drop).
    r2 = H.request("h1", H.prompt(71, 40), max_tokens=2)
    eng.run([r2], max_steps=eng.steps + 400)
    eng.shutdown()


def test_store_timeout_releases_blocks_after_the_detach(sc):
    """A store past save_timeout while the sidecar is alive but slow (stopped
    before the store was sent, resumed after the timeout): the worker ends
    the session with a Detach and vLLM keeps the request's blocks until the
    sidecar answered it, not for the whole write timeout; meanwhile another
    request that needs those blocks waits. A store copy still in flight at
    the Detach is discarded by the sidecar, so whatever the pool holds of
    the request is its own bytes: a second engine that loads it finds them
    (the harness checks every loaded block)."""
    extra = {"overlap_saves": True, "save_timeout": 1.0}
    eng = H.Engine(sc.sock, num_blocks=8, extra=dict(FROZEN, **extra))
    eng.worker.connector_worker.write_timeout = 60.0
    held = finished_answers(eng)
    pool = eng.sched.kv_cache_manager.block_pool
    free0 = pool.get_num_free_blocks()
    r = H.request("d0", H.prompt(75, 40), max_tokens=9)
    eng.add(r)

    def freeze(so, meta):
        if meta.store_req_ids and eng.steps > 0:
            eng.worker.connector_worker._finish_saves()  # the earlier stores are answered: only this one waits
            stop_process(sc.proc.pid)

    stopped = True
    try:
        while "d0" not in eng.finished:
            assert eng.steps < 20
            eng.step(freeze)
        assert held == {"d0": True}
        # Past save_timeout: the store timed out, the Detach is unanswered.
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            eng.step()
            time.sleep(0.01)
        assert eng.wstats["store_errors"] == 1, eng.wstats
        assert "d0" in eng.sched.requests, "blocks released before the sidecar ended the session"
        # Another request needing every block: it cannot get d0's meanwhile.
        r2 = H.request("d1", H.prompt(76, 6 * H.BLOCK + 4), max_tokens=2)
        eng.add(r2)
        for _ in range(5):
            eng.step()
            assert "d0" in eng.sched.requests and pool.get_num_free_blocks() < free0
        os.kill(sc.proc.pid, signal.SIGCONT)
        stopped = False
        t0 = time.monotonic()
        for _ in range(2000):
            if "d0" not in eng.sched.requests and "d1" in eng.finished:
                break
            eng.step()
            time.sleep(0.002)
        assert "d0" not in eng.sched.requests, "the held request was never released"
        assert time.monotonic() - t0 < 30, "released by the write timeout, not the Detach reply"
        assert "d1" in eng.finished
    finally:
        if stopped:
            os.kill(sc.proc.pid, signal.SIGCONT)
    eng.shutdown()
    # What the pool has of d0 (blocks 0-1 stored before the stop; block 2
    # only if its copy ended before the Detach) holds d0's bytes. The index
    # is trusted for a minute (a loaded machine cannot make it a miss).
    b = H.Engine(sc.sock, extra={"mirror_idle_ms": 60000, "mirror_max_lag_ms": 60000})
    again = H.request("d2", list(r.prompt_token_ids) + r.output_token_ids[:8], max_tokens=2)
    b.run([again])
    b.shutdown()
    assert b.wstats["load_error_blocks"] == 0 and b.wstats["loaded_blocks"] >= 2, (b.stats, b.wstats)
    assert b.checked_blocks > 0


def allocated(so) -> set:
    """The block ids a schedule allocated: a new request's, those added to
    a scheduled one (all of a resumed one's), in every KV cache group. The
    step writes no other block (a stored block is full: nothing writes it
    again while its request holds it)."""
    new = {b for nr in so.scheduled_new_reqs for g in nr.block_ids for b in g}
    return new | {b for nb in so.scheduled_cached_reqs.new_block_ids if nb for g in nb for b in g}


def zero_new_blocks(eng) -> None:
    """Make vLLM's scheduler ask the runner to zero every new block, as for
    a mixed-precision KV cache (needs_kv_cache_zeroing): Model Runner V2
    then writes them before it calls handle_preemptions."""
    eng.sched.needs_kv_cache_zeroing = True
    for m in eng.sched.kv_cache_manager.coordinator.single_type_managers:
        m._record_new_block_ids = True


class StoreGuard:
    """Checks, at each write of a step, that no block a store the workers
    have not seen end reads is written: the blocks the schedule allocated,
    written by the forward pass after handle_preemptions (any runner), and
    the blocks Model Runner V2 zeroes or copies into before it (writes_first:
    SchedulerOutput.new_block_ids_to_zero, kv_cache_block_copies); and
    counts the schedules that handed on a block the last step's stores read
    and the steps whose hooks blocked on stores."""

    def __init__(self, eng):
        self.eng, self.cw = eng, eng.worker.connector_worker
        self.handed = self.freed = self.blocked = self.checked = 0
        self.so = None
        self.last: set = set()
        cw, pool = self.cw, eng.sched.kv_cache_manager.block_pool
        hp, fin = cw.handle_preemptions, cw._finish_saves

        def handle_preemptions(meta):
            hp(meta)
            self.check(allocated(self.so), "written by this step's forward pass")

        def finish_saves(how=0):
            if how == 0 and cw._saving:
                self.blocked += 1
            return fin(how)

        cw.handle_preemptions, cw._finish_saves = handle_preemptions, finish_saves
        self.pool = pool

    def pending(self) -> set:
        return {b for e in self.cw._saving for b in e[4]}

    def check(self, written: set, what: str) -> None:
        self.checked += 1
        bad = self.pending() & written
        assert not bad, "blocks %s are %s while a store may read them" % (sorted(bad), what)

    def on_meta(self, so, meta) -> None:
        self.so = so
        self.handed += bool(self.last & allocated(so))
        self.freed += any(self.pool.blocks[b].ref_cnt == 0 for b in self.last)
        self.last = set(meta.store_block_ids)
        if self.cw.writes_first:
            early = set(so.new_block_ids_to_zero or ())
            early |= {c.dst_block_id for c in so.kv_cache_block_copies or ()}
            self.check(early, "zeroed or copied into before handle_preemptions")


@pytest.mark.parametrize("runner", ["v2", "v2-deferred", "v2-zeroing", "v1"])
def test_preempted_blocks_never_freed_under_a_store(sc, runner):
    """Too few blocks: vLLM preempts requests whose blocks the last step's
    stores read, which frees those blocks (no request_finished) for the
    same schedule to hand on. The V1 runner writes a step's blocks after
    handle_preemptions; so does Model Runner V2 for this model, unless it
    zeroes new blocks (v2-zeroing, as for a mixed-precision KV cache), which
    it does before: at every write, no block a store the workers have not
    seen end reads is written. With a speculator, Model Runner V2 calls
    wait_for_save after get_transfer_results (v2-deferred)."""
    eng = H.Engine(sc.sock, num_blocks=10, max_num_batched_tokens=32, extra={"overlap_saves": True})
    eng.defer_finalize = runner == "v2-deferred"
    if runner == "v2-zeroing":
        zero_new_blocks(eng)
    cw = eng.worker.connector_worker
    cw.writes_first = runner != "v1"
    reqs = [H.request("p%d" % i, H.prompt(10 + i, 47 + 3 * i), max_tokens=30) for i in range(5)]
    g = StoreGuard(eng)
    eng.run(reqs, on_meta=g.on_meta)
    eng.shutdown()
    assert eng.stats["resumed"] > 0, eng.stats
    assert g.freed > 0, "no step freed a block stored in the step before"
    assert g.checked >= eng.steps
    assert eng.wstats["store_errors"] == 0
    if runner != "v2-zeroing":
        # Waits only where a store's blocks are handed on: here no schedule
        # hands on a block the step before stored (a preemption frees the
        # victim's last block first), so every store runs on.
        assert g.handed == 0 and g.blocked == 0, (g.handed, g.blocked)


def test_no_sidecar_serves_without_cache():
    eng = H.Engine(NOWHERE)
    reqs = shared_prompts("n")
    eng.run(reqs)
    eng.shutdown()
    assert eng.stats["hit_blocks"] == 0 and eng.wstats["stored_blocks"] == 0
    assert set(eng.outputs) == {r.request_id for r in reqs}
