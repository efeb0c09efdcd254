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
    # The requests whose blocks this step's stores read (each once): a
    # request that finishes while they may be in flight is held (below).
    store_req_ids: list[str] = field(default_factory=list)
    # Requests finished since the last step for which request_finished
    # returned True: vLLM keeps their blocks until every worker reports them
    # in finished_sending, which each does once no store of its own that
    # read them is still unanswered.
    held_req_ids: list[str] = field(default_factory=list)
    # The stores still unanswered must be complete before this step writes
    # any block (handle_preemptions): a request was preempted since, or a
    # group is not plain full attention, so blocks they read may have been
    # handed to another request in this step's schedule. Otherwise the
    # workers leave them running one more step (never longer). Enough for
    # the V1 runner, which calls handle_preemptions before it writes blocks.
    wait_saves: bool = True
    # The next schedule may free blocks of live requests (a preemption is
    # possible: the blocks it may allocate exceed the free ones; or a group
    # is not plain full attention). Workers whose runner writes blocks
    # before handle_preemptions (Model Runner V2 zeroes and copies into new
    # blocks first) then wait for every store before the step returns.
    settle_saves: bool = True
