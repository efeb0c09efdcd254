#!/usr/bin/env python3
"""A real vLLM engine (CPU) with the ringside connector, driven over stdin
and stdout, whose requests carry vLLM's KvHintsEnvelope through the
engine's API (``LLMEngine.add_request(..., kv_hints=)``), for
test_vllm_hints_e2e.py. Runs under the .venv-vllm interpreter with
PYTHONPATH including connector/python.

    run_hints_engine.py --model DIR --socket SOCK [--connector-config JSON]

Prints ``{"ready": true}`` once the engine is up, then answers each line
of stdin (JSON) with one line of stdout (JSON):

- ``{"op": "run", "requests": [{"id", "prompt", "actions"}]}``: adds the
  requests in one go (``actions``: a list of ``[action_type, payload]``
  for the envelope, or null for none), steps the engine until they
  finished and the connector has settled them (their stores answered,
  their hints sent and the sidecar's answers read, with one-token
  requests of no interest to step an idle engine), then pings the sidecar
  on the scheduler's session, so that it has applied every Retain before
  the answer; answers ``{"stats": the scheduler side's counters,
  "worker": the worker side's}``;
- ``{"op": "quit"}`` (or the end of stdin): exits at once.

The engine's own prefix cache is off, so every hit is the sidecar's.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# Seconds to settle one run in, at most (a run takes a fraction of one; a
# step is a fraction of a millisecond while a load waits for the sidecar,
# so a count of steps is no bound).
MAX_S = 90.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--connector-config", default="{}", help="JSON merged into kv_connector_extra_config")
    a = ap.parse_args()
    # The answers get stdout to themselves: whatever else writes to it (the
    # engine's messages) goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    extra = {"socket": a.socket, "timeout": 2.0, "mirror": False}
    extra.update(json.loads(a.connector_config))
    llm = LLM(
        model=a.model,
        dtype="float32",
        max_model_len=1024,
        block_size=32,
        enforce_eager=True,
        seed=0,
        distributed_executor_backend="uni",
        enable_prefix_caching=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="RingsideConnector",
            kv_connector_module_path="ringside.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    eng = llm.llm_engine
    side = eng.engine_core.engine_core.scheduler.connector.connector_scheduler
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    nudges = 0

    def envelope(rid, actions):
        if actions is None:
            return None
        return KvHintsEnvelope(
            protocol_version="1.0",
            message_id="m-" + rid,
            actions=[
                KvHintAction(action_id="%s-%d" % (rid, i), action_type=t, action_version="1.0", payload=p)
                for i, (t, p) in enumerate(actions)
            ],
        )

    def settled() -> bool:
        return not (side.holding or side._retain_later or side.hints.awaited)

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        want = set()
        for r in cmd["requests"]:
            eng.add_request(r["id"], r["prompt"], sp, kv_hints=envelope(r["id"], r.get("actions")))
            want.add(r["id"])
        deadline = time.monotonic() + MAX_S
        while True:
            if not want and settled():
                break
            if time.monotonic() > deadline:
                raise SystemExit("not settled in %gs: %s" % (MAX_S, sorted(want)))
            if not eng.has_unfinished_requests():
                # An idle engine takes no step: a request of no interest
                # (no full block) makes it take the ones that settle.
                nudges += 1
                eng.add_request("nudge-%d" % nudges, "n%d" % (nudges % 10), sp)
            for o in eng.step():
                if o.finished:
                    want.discard(o.request_id)
        while eng.has_unfinished_requests():  # a last nudge
            eng.step()
        side.link.session.ping()  # the sidecar has handled every record sent before it
        # The workers' side runs in this process too (the uni executor).
        out.write(json.dumps({"stats": side.stats, "worker": get_kv_transfer_group().stats}) + "\n")
        out.flush()
    # Nothing to keep: the sidecar ends the sessions when the process exits
    # (a clean shutdown of the engine takes seconds).
    out.close()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
