"""A refused load is a miss, once (ringside.vllm.loads): whatever the
sidecar refuses (the uid's share of pins, a lease shorter than the hit),
the request is rescheduled once by vLLM, never claims those blocks again,
and computes them; the refusal is counted by reason, and the local index
stops offering the blocks. Under vLLM's own Scheduler (vllm_harness) with a
real sidecar."""

from __future__ import annotations

import pytest
import vllm_harness as H  # skips this module where vLLM is not importable

PROMPT = 4 * H.BLOCK + 1  # 4 full blocks a prompt (and one output token)


class Stop(Exception):
    """Ends a step after its metadata is built: the workers never load it,
    so the step's leases stay held."""


def stop(so, meta):
    raise Stop


def store(sock: str, *prompts) -> None:
    """Store each prompt's 4 blocks through an engine of its own."""
    e = H.Engine(sock, extra={"mirror": False})
    e.run([H.request("store-%d" % i, p, 1) for i, p in enumerate(prompts)])
    for _ in range(20):  # the last step's stores are answered within a step or two
        e.step()
    e.shutdown()


def hold_lease(sock: str, tokens) -> H.Engine:
    """An engine of the same uid whose request's lease on tokens' blocks is
    granted and never released (its load never runs)."""
    e = H.Engine(sock, extra={"mirror": False})
    e.add(H.request("holder", tokens, 1))
    for _ in range(50):
        try:
            e.step(on_meta=lambda so, meta: meta.loads and stop(so, meta))
        except Stop:
            return e
    raise AssertionError("the holder's lease was never granted")


@pytest.fixture
def tight(start_sidecar):
    # 16 blocks (4 KiB slots); the uid's leases may pin 4 of them.
    return start_sidecar(pool="64KiB", slot="4KiB", args=["--limits.pin-share", "0.25"])


def test_a_load_refused_for_the_uids_share_is_a_miss_once(tight):
    """Another request of the uid holds a lease on its whole share: a
    request that hits other blocks is refused its lease (status TOO_LARGE).
    It is rescheduled once, computes, and finishes; it never claims the
    blocks again (before, it claimed them step after step for as long as
    the other lease lived)."""
    held, mine = H.prompt(1, PROMPT), H.prompt(2, PROMPT)
    store(tight.sock, held, mine)
    holder = hold_lease(tight.sock, held)
    b = H.Engine(tight.sock, extra={"mirror": False})
    try:
        b.run([H.request("mine", mine, 4)], max_steps=100)
        st = b.stats
        assert st["load_refusals"] == 1 and st["load_refused_share"] == 1, st
        assert b.wstats["loaded_blocks"] == 0
        assert b.sched.requests.get("mine") is None and "mine" in b.finished
        assert b.outputs["mine"] == [H.sampled("mine", PROMPT + i) for i in range(4)]
    finally:
        b.shutdown()
        holder.shutdown()


def test_a_short_lease_is_claimed_once(start_sidecar):
    """A lease shorter than the hit (the share admits one block): the
    covered block is loaded, the rest computed, with one reschedule (before,
    one more block a reschedule)."""
    sc = start_sidecar(
        pool="64KiB", slot="4KiB", args=["--limits.pin-share", "0.0625", "--limits.retain-share", "0.0625"]
    )
    tokens = H.prompt(3, PROMPT)
    store(sc.sock, tokens)
    b = H.Engine(sc.sock, extra={"mirror": False})
    try:
        b.run([H.request("r", tokens, 2)], max_steps=100)
        st = b.stats
        assert st["load_refusals"] == 1 and st["load_refused_short"] == 1, st
        w = b.wstats
        assert w["loaded_blocks"] == 1 and w["loads"] == 1 and w["load_error_blocks"] == 3, w
        assert b.checked_blocks > 0
    finally:
        b.shutdown()


def test_the_local_index_stops_offering_refused_blocks(tight):
    """With the local index on, the refused blocks are withheld from it: the
    next request that runs into them asks the sidecar instead of trusting
    the index (and is refused once itself, while the lease is held)."""
    held, mine = H.prompt(4, PROMPT), H.prompt(5, PROMPT)
    store(tight.sock, held, mine)
    holder = hold_lease(tight.sock, held)
    b = H.Engine(tight.sock, extra={"mirror": True})
    try:
        for _ in range(20):  # the index copies the namespace and goes live
            b.step()
        assert b.sside.mirror.state == b.sside.mirror.LIVE
        b.run([H.request("one", mine, 1)], max_steps=100)
        assert b.stats["load_refusals"] == 1
        assert set(b.sside.mirror.withheld) == set(H.request("x", mine).block_hashes)
        before = b.sside.mirror.stats["withheld"]
        assert b.sched.reset_prefix_cache()  # so that vLLM's own cache does not answer
        b.run([H.request("two", mine, 1)], max_steps=100)
        assert b.sside.mirror.stats["withheld"] > before
        assert b.stats["load_refusals"] == 2
    finally:
        b.shutdown()
        holder.shutdown()


def test_a_load_the_workers_fail_is_a_miss_once(start_sidecar):
    """The lease is granted, then ends before the workers load (released
    behind their back): their Load fails, vLLM reschedules the request, and
    it computes the blocks instead of claiming them a second time."""
    from ringside import schema as _s

    sc = start_sidecar()
    tokens = H.prompt(6, PROMPT)
    store(sc.sock, tokens)
    b = H.Engine(sc.sock, extra={"mirror": False})

    def release_first(so, meta):
        for spec in meta.loads:
            if spec.lease and not b.sside.stats["load_refused_error"]:
                s = b.sside.link.session
                s.send(_s.TYPE_RELEASE, _s.encode_release(spec.lease))
                s.ping()  # handled before the workers' Load

    try:
        b.run([H.request("r", tokens, 2)], max_steps=100, on_meta=release_first)
        st, w = b.stats, b.wstats
        assert st["load_refusals"] == 1 and st["load_refused_error"] == 1, st
        assert w["loads"] == 1 and w["loaded_blocks"] == 0, w
        assert b.outputs["r"] == [H.sampled("r", PROMPT + i) for i in range(2)]
    finally:
        b.shutdown()
