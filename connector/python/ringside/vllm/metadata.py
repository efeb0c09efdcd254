"""What the scheduler side tells the workers each step (pickled across
processes: keep these classes where they are)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadSpec:
    """A load for one request: copy the lease's blocks 0..n-1 into block_ids."""

    req_id: str
    lease: int
    block_ids: list[int]  # engine blocks to fill from the lease's blocks 0..n-1
    error_block_ids: list[int]  # promised blocks the lease could not cover
    # Several KV cache groups: the other groups' (lease, engine blocks), and
    # the load is one for the whole request: any error fails all of it (the
    # workers report it in failed_recving; vLLM recomputes the request).
    more: Sequence = ()
    whole: bool = False


@dataclass
class RingsideConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    # The blocks that become full in this step, of every request together:
    # store_digests[i] holds vLLM's hashes (joined) of a run of blocks whose
    # engine block ids come next in store_block_ids, in the same order.
    store_digests: list[bytes] = field(default_factory=list)
    store_block_ids: list[int] = field(default_factory=list)
    # The previous step's stores must be complete before this step's forward
    # pass: a request whose blocks they read finished or was preempted since,
    # so those blocks may be handed to another request now. Otherwise the
    # workers leave them running one more step (never longer).
    wait_saves: bool = True
