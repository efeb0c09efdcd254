"""vLLM KV connector backed by the ringside sidecar.

Load it with::

    --kv-transfer-config '{"kv_connector": "RingsideConnector",
                           "kv_connector_module_path": "ringside.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"socket": "/dev/shm/ringside/ringside.sock"}}'

or, once the package is installed, through its ``vllm.general_plugins`` entry
point, which registers the name ``RingsideConnector`` with vLLM's connector
factory (then ``kv_connector_module_path`` can be left out). The keys of
``kv_connector_extra_config`` are those of ringside.plugin.config (the table
in docs/configuration.md); an unknown or mistyped key fails the engine's start.

How to run it and what to expect: docs/vllm.md; how it works, and the local
index of the cache: docs/architecture.md. The parts:

- connector.py: the KVConnectorBase_V1 class, dispatching by role;
- scheduler.py: the scheduler side (admission.py, index.py, loads.py, store_plan.py);
- worker.py: the worker side (registration, loads, stores, save overlap);
- metadata.py: what the scheduler sends the workers each step;
- engine.py: what is read from vLLM (namespace, shard, cache manager).

Nothing here may fail or hang a request: every sidecar call has a deadline,
every error is a miss (0 matched tokens) or a load error that vLLM recomputes
(the connector sets ``kv_load_failure_policy`` to ``recompute``). Without a
sidecar, or after it dies, the engine keeps serving and the connector
re-attaches in the background (at most once per ``reattach_interval``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .connector import RingsideConnector
from .metadata import LoadSpec, RingsideConnectorMetadata

__all__ = ["RingsideConnector", "RingsideConnectorMetadata", "LoadSpec", "register_plugin", "reset_prefix_cache"]

logger = logging.getLogger("ringside.vllm")


def register_plugin() -> None:
    """``vllm.general_plugins`` entry point: register RingsideConnector with
    vLLM's connector factory, so the name alone selects it."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        if "RingsideConnector" not in getattr(KVConnectorFactory, "_registry", {}):
            KVConnectorFactory.register_connector("RingsideConnector", "ringside.vllm", "RingsideConnector")
    except Exception as e:  # noqa: BLE001 - a plugin must never break vLLM's start
        logger.warning("ringside: could not register the vLLM connector: %s", e)


def reset_prefix_cache(llm: Any, timeout: float = 10.0) -> bool:
    """vLLM's ``LLM.reset_prefix_cache()``, once it can succeed.

    The connector holds a finished request's blocks until the sidecar has
    read them for its stores (``request_finished`` returns True; vLLM frees
    them when a worker reports the request in ``finished_sending``, at a
    later engine step). An offline ``LLM.generate`` returns before that
    step, so a reset right after it fails while blocks are held. This steps
    an in-process engine core while it has such requests (a multiprocess
    engine core steps by itself; it is waited for), then resets. False if
    the reset still fails after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    eng = llm.llm_engine
    core = getattr(getattr(eng, "engine_core", None), "engine_core", None)  # in-process client only
    sched = getattr(core, "scheduler", None)
    while True:
        if llm.reset_prefix_cache():
            return True
        if time.monotonic() >= end:
            return False
        if sched is not None and sched.has_requests():
            eng.step()
        else:
            time.sleep(0.005)
