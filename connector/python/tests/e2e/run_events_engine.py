#!/usr/bin/env python3
"""A real vLLM engine (CPU) with the ringside connector and vLLM's own KV
event publisher (ZMQ PUB and replay ROUTER), and a subscriber that records
the stream and decodes it with vLLM's own event classes. Used by
test_vllm_events_e2e.py; runs under the .venv-vllm interpreter with
PYTHONPATH including connector/python.

    run_events_engine.py --model DIR --socket SOCK --pub-port P --replay-port R
                         --out OUT.json --prompts FILE.json [--tp N]
                         [--capture FILE.jsonl] [--hold READY DONE]

It generates the prompts (each file entry: a list of prompts generated
together, one after the other), then keeps the engine stepping on an
unrelated request until the connector's events are published (vLLM takes a
connector's events only in a step). Then it reads, through a client session
of its own in the connector's namespace, the blocks the sidecar holds
(EventSnapshot gives their descriptions, Snapshot their digests) and the
sidecar's Lookup of the last group's first prompt, asks the replay socket for the whole
stream, writes it all to OUT.json and, with --hold, writes READY and waits
for DONE (so that the test can run `ringside events` against the live
publisher) before shutting down.
"""

import argparse
import json
import os
import sys
import threading
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

TOPIC = "kv@127.0.0.1:8000@tiny"


class Recorder(threading.Thread):
    """A SUB socket on the publisher: every message, raw and decoded."""

    def __init__(self, endpoint):
        super().__init__(daemon=True)
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 100)
        self.sock.connect(endpoint)
        self.frames = []
        self.lock = threading.Lock()
        self.stop = False

    def run(self):
        import zmq

        while not self.stop:
            try:
                f = self.sock.recv_multipart()
            except zmq.Again:
                continue
            with self.lock:
                self.frames.append(f)

    def snapshot(self):
        with self.lock:
            return list(self.frames)


def decode(frames):
    """[(seq, [event dicts])] decoded with vLLM's own classes."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    out = []
    for topic, seq, payload in frames:
        b = dec.decode(payload)
        evs = []
        for e in b.events:
            d = msgspec.to_builtins(e)
            d["type"] = type(e).__name__
            evs.append(d)
        out.append({"topic": topic.decode(), "seq": int.from_bytes(seq, "big"), "ts": b.ts, "events": evs})
    return out


def replay(endpoint, start=0, timeout=5.0):
    """[(seq, payload)] from the replay socket, from start on."""
    import zmq

    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            f = s.recv_multipart()
            seq = int.from_bytes(f[2], "big", signed=True)
            if seq == -1:
                return out
            out.append((seq, f[3]))
    finally:
        s.close()


def steps_until_quiet(llm, rec, quiet_s=0.6, most_s=60.0):
    """Step the engine on an unrelated request until no message arrived for
    quiet_s (the connector's events of the blocks stored so far are
    published: it polls the sidecar at the end of steps)."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=800, ignore_eos=True)
    rid = "keeper-%f" % time.time()
    eng.add_request(rid, "Keeper: an unrelated request keeps the engine stepping.", sp)
    t0 = time.time()
    last_n, last_t = len(rec.snapshot()), time.time()
    while time.time() - t0 < most_s:
        eng.step()
        n = len(rec.snapshot())
        if n != last_n:
            last_n, last_t = n, time.time()
        elif time.time() - last_t > quiet_s and time.time() - t0 > 2 * quiet_s:
            break
        time.sleep(0.005)
    eng.abort_request([rid])
    while eng.has_unfinished_requests():
        eng.step()


def probe(conn, socket_path):
    """A client session in the connector's namespace (role client)."""
    from ringside.client import Session

    a = conn.connector_scheduler.link.attach_args
    return Session.attach(
        socket_path,
        role=3,
        instance="events-probe",
        model=a["model"],
        layout=a["layout"],
        salt=a.get("salt", ""),
        world_size=a["world_size"],
        digest_width=32,
        timeout=5.0,
    )


def sidecar_view(s, prompt_digests):
    """The sidecar's present digests (Snapshot), its described ones
    (EventSnapshot) and its Lookup of the prompt's digests."""
    present, described = [], {}
    f = 0
    while True:
        r = s.snapshot(f)
        present += [d.hex() for d in r.digests()]
        if r.done:
            break
        f = r.next
    f = 0
    while True:
        r = s.event_snapshot(f)
        for e in r.events():
            described[e.digest.hex()] = {"parent": e.parent.hex() if e.parent else None, "tokens": e.token_ids()}
        if r.done:
            break
        f = r.next
    hits = 0
    if prompt_digests:
        s.put_hashes(1, b"".join(prompt_digests))
        hits = s.lookup(1, 0, len(prompt_digests))
        s.drop_hashes(1)
    return present, described, hits


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pub-port", type=int, required=True)
    ap.add_argument("--replay-port", type=int, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--capture")
    ap.add_argument("--hold", nargs=2, metavar=("READY", "DONE"))
    ap.add_argument(
        "--reset", action="store_true", help="reset vLLM's prefix cache at the end (it publishes AllBlocksCleared)"
    )
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    # vLLM binds its PUB socket only for a wildcard endpoint (another one it
    # connects to); the replay socket it always binds, here to 127.0.0.1.
    pub = "tcp://*:%d" % a.pub_port
    rep = "tcp://127.0.0.1:%d" % a.replay_port
    rec = Recorder("tcp://127.0.0.1:%d" % a.pub_port)
    rec.start()
    kw = dict(
        model=a.model,
        dtype="float32",
        max_model_len=1024,
        block_size=32,
        enforce_eager=True,
        seed=0,
        distributed_executor_backend="uni",
        enable_prefix_caching=True,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=pub, replay_endpoint=rep, topic=TOPIC
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="RingsideConnector",
            kv_connector_module_path="ringside.vllm",
            kv_role="kv_both",
            # Prompt blocks only: the keeper request (steps_until_quiet)
            # decodes up to 800 tokens, and its blocks, stored as they fill,
            # would evict the prompts' blocks at a rate that depends on the
            # machine's speed (the checks compare the stream with the pool).
            kv_connector_extra_config={
                "socket": a.socket,
                "timeout": 2.0,
                "reattach_interval": 1.0,
                "store_decode_every": 0,
            },
        ),
    )
    if a.tp > 1:
        kw.update(tensor_parallel_size=a.tp, distributed_executor_backend="mp")
    llm = LLM(**kw)
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    time.sleep(0.5)  # the subscriber's connection (a PUB drops what no one receives)
    groups = json.load(open(a.prompts))
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    first_tokens = None
    for group in groups:
        outs = llm.generate(group, sp, use_tqdm=False)
        if outs:  # the probe prompt: the last group's first (the most recently stored)
            first_tokens = list(outs[0].prompt_token_ids)
        steps_until_quiet(llm, rec)
    steps_until_quiet(llm, rec)
    if a.reset:
        # The engine's GPU prefix cache goes (AllBlocksCleared, which routers
        # apply to every tier): the connector announces the sidecar's again.
        assert llm.reset_prefix_cache()
        steps_until_quiet(llm, rec)

    frames = rec.snapshot()
    batches = decode(frames)
    s = probe(conn, a.socket)
    # The probe prompt's digests: vLLM's hashes of its full blocks, from the
    # request the engine keeps none of: recompute them as vLLM does.
    prompt_digests = []
    if first_tokens is not None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import hash_block_tokens  # NONE_HASH: set by the engine

        fn = get_hash_fn_by_name(llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo)
        parent = None
        for i in range(len(first_tokens) // 32):
            parent = hash_block_tokens(fn, parent, first_tokens[i * 32 : (i + 1) * 32], None)
            prompt_digests.append(parent)
    present, described, hits = sidecar_view(s, prompt_digests)
    got_replay = replay(rep, 0)
    # The live stream as far as the replay went: a batch published after the
    # first snapshot (the probe's step) is in the replay, and reaches the
    # subscriber a moment later.
    last = got_replay[-1][0] if got_replay else -1
    live = rec.snapshot()
    deadline = time.time() + 10
    while (not live or int.from_bytes(live[-1][1], "big") < last) and time.time() < deadline:
        time.sleep(0.05)
        live = rec.snapshot()
    live = [f for f in live if int.from_bytes(f[1], "big") <= last]
    report = {
        "batches": batches,
        "present": present,
        "present_external": [maybe_convert_block_hash(bytes.fromhex(d)) for d in present],
        "described": described,
        "prompt_external": [maybe_convert_block_hash(d) for d in prompt_digests],
        "prompt_digests": [d.hex() for d in prompt_digests],
        "prompt_tokens": first_tokens,
        "sidecar_prefix_hits": hits,
        "replay": [[seq, p.hex()] for seq, p in got_replay],
        "live": [[int.from_bytes(f[1], "big"), f[2].hex()] for f in live],
        "connector_stats": {k: v for k, v in conn.stats.items() if isinstance(v, (int, str))},
        "feed_stats": conn.connector_scheduler.events.feed.stats if conn.connector_scheduler.events else None,
        "pub": "tcp://127.0.0.1:%d" % a.pub_port,
        "replay_endpoint": rep,
    }
    if a.capture:
        with open(a.capture, "w") as f:
            for topic, seq, payload in frames:
                f.write(
                    json.dumps({"topic": topic.decode(), "seq": int.from_bytes(seq, "big"), "payload": payload.hex()})
                    + "\n"
                )
    json.dump(report, open(a.out, "w"))
    if a.hold:
        open(a.hold[0], "w").write("ready\n")
        t0 = time.time()
        poke = a.hold[1] + ".poke"
        while not os.path.exists(a.hold[1]) and time.time() - t0 < 600:
            if os.path.exists(poke):
                # More live batches, for a subscriber that joined late and
                # replays only on a gap it sees (Dynamo's indexer): a short
                # request fills one block; then the sidecar's view again.
                os.unlink(poke)
                llm.generate(["Poke: one more block of tokens, please. " * 2], sp, use_tqdm=False)
                steps_until_quiet(llm, rec)
                present, described, hits = sidecar_view(s, prompt_digests)
                json.dump({"sidecar_prefix_hits": hits}, open(poke + ".json.tmp", "w"))
                os.rename(poke + ".json.tmp", poke + ".json")
            time.sleep(0.05)
        # The whole stream, the batches published while held too.
        json.dump({"batches": decode(rec.snapshot())}, open(a.out + ".final", "w"))
    rec.stop = True
    s.close()
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
