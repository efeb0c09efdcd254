"""An engine without a model, for the vLLM connector's unit tests.

vLLM's own Scheduler (with its KV cache manager, prefix cache, chunked
prefill and preemption) drives the connector's scheduler side; the worker
side runs in the same process on real KV cache tensors registered with a
real sidecar (process_vm_readv/writev on this process). The "model" writes,
for every scheduled token, a value that depends only on the token and its
position into every layer's K and V at the token's slot, and samples a token
that depends only on the request and its length; so a block holds the same
bytes whether it was computed, found in vLLM's prefix cache or loaded from
the sidecar, and :meth:`Engine.step` checks that, for every scheduled
request, every block before its first scheduled token holds the right bytes.

Needs the vLLM venv (``make vllm-venv``; ``make pytest`` runs these tests
with its interpreter). Elsewhere the importing test module is skipped, except
under CI=true, where a missing vLLM is an error.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any, Optional

import pytest

try:
    import torch
    from vllm import SamplingParams
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus  # noqa: F401 - RequestStatus: for the tests
    from vllm.v1.structured_output import StructuredOutputManager
except Exception as e:  # noqa: BLE001 - ImportError, or a module that fails at import
    if os.environ.get("CI"):
        raise
    pytest.skip(
        "vLLM is not importable here (%s: %s): run `make vllm-venv`, then these tests with "
        ".venv-vllm/bin/python (make pytest does)" % (type(e).__name__, e),
        allow_module_level=True,
    )

from ringside.vllm import RingsideConnector  # noqa: E402

BLOCK = 16  # tokens a block
LAYERS, HEADS, HEAD = 2, 1, 8  # a block of one layer: 2 x 16 x 1 x 8 float32 = 1 KiB; a page 2 KiB
EOS = 2
_none_hash = False


def tiny_model_dir() -> str:
    """A model directory with just the config vLLM reads (no weights, no tokenizer)."""
    d = tempfile.mkdtemp(prefix="rs-unit-model-")
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=260,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=HEADS,
        head_dim=HEAD,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        torch_dtype="float32",
        eos_token_id=EOS,
    )
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


_MODEL: dict = {}


def model_config() -> "ModelConfig":
    """One ModelConfig per test session (reading it costs seconds)."""
    if "mc" not in _MODEL:
        _MODEL["mc"] = ModelConfig(model=tiny_model_dir(), dtype="float32", seed=0, skip_tokenizer_init=True)
    return _MODEL["mc"]


def vllm_config(extra: dict, max_num_batched_tokens: int = 256, max_num_seqs: int = 16) -> "VllmConfig":
    mc = model_config()
    sc = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    kvt = KVTransferConfig(
        kv_connector="RingsideConnector",
        kv_connector_module_path="ringside.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=dict(extra),
    )
    return VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=kvt,
                      device_config=DeviceConfig("cpu"))  # fmt: skip


def kv_cache_config(num_blocks: int, groups: Optional[list] = None) -> "KVCacheConfig":
    """One full-attention group of LAYERS layers, or (groups: a list of
    "full" or a sliding window in tokens) one group of LAYERS layers each,
    their layers interleaved as in a real hybrid model (group g has layers
    g, g + len(groups), ...)."""
    if groups is None:
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
        names = ["model.layers.%d.self_attn.attn" % i for i in range(LAYERS)]
        return KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
        )
    out = []
    for g, kind in enumerate(groups):
        kw = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
        spec = FullAttentionSpec(**kw) if kind == "full" else SlidingWindowSpec(sliding_window=int(kind), **kw)
        names = ["model.layers.%d.self_attn.attn" % (g + i * len(groups)) for i in range(LAYERS)]
        out.append(KVCacheGroupSpec(names, spec))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=out)


def layer_index(name: str) -> int:
    return int(name.split(".")[2])


def request(rid: str, tokens: list[int], max_tokens: int = 8, kv_transfer_params: Optional[dict] = None) -> "Request":
    """A vLLM Request with vLLM's sha256 block hashing (and the request
    body's kv_transfer_params, where vLLM's OpenAI server puts them)."""
    global _none_hash
    if not _none_hash:
        init_none_hash(sha256)
        _none_hash = True
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if kv_transfer_params is not None:
        sp.extra_args = {"kv_transfer_params": kv_transfer_params}
    sp.update_from_generation_config({}, EOS)
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def prompt(seed: int, n: int, prefix: Optional[list[int]] = None) -> list[int]:
    """n tokens: the prefix, then a run that depends on seed."""
    p = list(prefix or [])
    while len(p) < n:
        p.append(4 + (seed * 131 + len(p) * 17) % 250)
    return p[:n]


def kv_value(token: int, pos: int, layer: int, kv: int) -> float:
    return float(token * 1009 + pos * 7 + layer * 3 + kv)


def sampled(rid: str, length: int) -> int:
    return 4 + (sum(map(ord, rid)) * 31 + length * 13) % 250


def runner_output(rids: list[str], sampled_ids: list[list[int]], kvo: Any) -> "ModelRunnerOutput":
    """The workers' ModelRunnerOutput of a step (vLLM 0.34 dropped its
    req_id_to_index)."""
    kw: dict = {}
    if "req_id_to_index" in getattr(ModelRunnerOutput, "__dataclass_fields__", {}):
        kw["req_id_to_index"] = {r: i for i, r in enumerate(rids)}
    return ModelRunnerOutput(
        req_ids=rids,
        sampled_token_ids=sampled_ids,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kvo,
        **kw,
    )


class Engine:
    """vLLM's scheduler + the connector's two sides + a model stand-in (module doc)."""

    def __init__(
        self,
        sock: str,
        num_blocks: int = 64,
        extra: Optional[dict] = None,
        groups: Optional[list] = None,
        **sched_kw: Any,
    ):
        cfg = {"socket": sock, "timeout": 2.0, "reattach_interval": 0.05, "max_wait_us": 200000}
        cfg.update(extra or {})
        self.vc = vllm_config(cfg, **sched_kw)
        self.vc.cache_config.num_gpu_blocks = num_blocks
        self.kv_cache_config = kcc = kv_cache_config(num_blocks, groups)
        self.sched = Scheduler(
            vllm_config=self.vc,
            kv_cache_config=kcc,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vc),
            block_size=BLOCK,
        )
        self.conn: RingsideConnector = self.sched.connector
        assert isinstance(self.conn, RingsideConnector), type(self.conn)
        self.sside = self.conn.connector_scheduler
        self.worker = RingsideConnector(self.vc, KVConnectorRole.WORKER, kcc)
        # CPU attention's layout: (2, blocks, block_size, heads, head) a
        # layer. With several KV cache groups the i-th layer of every group
        # shares one tensor, as in vLLM: a block belongs to one group at a
        # time and holds that group's layers.
        self.groups = kcc.kv_cache_groups
        self.tensors = [torch.zeros(2, num_blocks, BLOCK, HEADS, HEAD, dtype=torch.float32) for _ in range(LAYERS)]
        self.kv = {name: self.tensors[i] for g in self.groups for i, name in enumerate(g.layer_names)}
        self.null_id = self.sched.kv_cache_manager.block_pool.null_block.block_id
        self.worker.register_kv_caches(self.kv)
        self.steps = 0
        self.defer_finalize = False  # wait_for_save after get_transfer_results (step)
        self.metas: list = []  # every step's RingsideConnectorMetadata
        self.outputs: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.params: dict[str, dict] = {}  # kv_transfer_params of finished requests' outputs
        self.checked_blocks = 0

    # -- the model stand-in ------------------------------------------------------

    def _block_ids(self, rid: str, group: int = 0) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(rid)[group])

    def _check_prefix(self, req: "Request", start: int) -> None:
        """Every full block before the request's first scheduled token
        (start) holds the bytes of its tokens (computed, prefix-cached or
        loaded), in every group's layers; a sliding window's blocks that
        vLLM dropped (null) are skipped, and those inside the window of the
        first scheduled token must be there."""
        toks = req.all_token_ids
        for gi, g in enumerate(self.groups):
            ids = self._block_ids(req.request_id, gi)
            window = getattr(g.kv_cache_spec, "sliding_window", None)
            need = max(0, start - window + 1) // BLOCK if window else 0
            name = g.layer_names[0]
            li = layer_index(name) if len(self.groups) > 1 else 0
            for b in range(start // BLOCK):
                if ids[b] == self.null_id:
                    assert b < need, "request %s group %d block %d is needed but null" % (req.request_id, gi, b)
                    continue
                want = torch.tensor([kv_value(toks[b * BLOCK + o], b * BLOCK + o, li, 0) for o in range(BLOCK)])
                got = self.kv[name][0, ids[b], :, 0, 0]
                assert torch.equal(got, want), "request %s group %d block %d (engine block %d) holds other bytes" % (
                    req.request_id,
                    gi,
                    b,
                    ids[b],
                )
                self.checked_blocks += 1

    def _forward(self, so: Any) -> dict:
        sampled_ids = {}
        reqs = self.sched.requests
        multi = len(self.groups) > 1
        for rid, n in so.num_scheduled_tokens.items():
            req = reqs[rid]
            # schedule() has counted the scheduled tokens as computed already.
            start = req.num_computed_tokens - n
            self._check_prefix(req, start)
            toks = req.all_token_ids
            for gi, g in enumerate(self.groups):
                ids = self._block_ids(rid, gi)
                names = g.layer_names if multi else sorted(g.layer_names)
                for pos in range(start, start + n):
                    blk, off = ids[pos // BLOCK], pos % BLOCK
                    assert blk != self.null_id, "a scheduled token's block is the null block"
                    for i, name in enumerate(names):
                        li = layer_index(name) if multi else i
                        for kv in range(2):
                            self.kv[name][kv, blk, off] = kv_value(toks[pos], pos, li, kv)
            end = start + n
            sampled_ids[rid] = [sampled(rid, end)] if end >= req.num_tokens else []
        return sampled_ids

    # -- driving -----------------------------------------------------------------

    def add(self, req: "Request") -> None:
        self.sched.add_request(req)

    def step(self, on_meta: Optional[Any] = None) -> Any:
        """One engine step; on_meta(so, meta) runs after the scheduler built
        the step (its blocks still allocated), before the workers run it."""
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        self.metas.append(meta)
        if on_meta is not None:
            on_meta(so, meta)
        w = self.worker
        # In the order of vLLM's model runners (0.32 to 0.34): asynchronous
        # loads start after the forward pass, unless a connector loads
        # synchronously in this step (start_load_kv then runs before it).
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        sync = getattr(so, "has_sync_kv_loads", True)
        if sync:
            w.start_load_kv(None)
        toks = self._forward(so)
        if not sync:
            w.start_load_kv(None)
        # Model Runner V2 with a speculator (vLLM 0.33 and 0.34 on GPUs)
        # collects the finished sets before it stores: post_forward with
        # defer_finalize, then finalize_step after the drafter.
        if not self.defer_finalize:
            w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        if self.defer_finalize:
            w.wait_for_save()
        w.clear_connector_metadata()
        # Nothing ever writes vLLM's null block: no load lands in it.
        for t in self.tensors:
            assert not t[:, self.null_id].any(), "the null block was written"
        rids = list(so.num_scheduled_tokens)
        kvo = KVConnectorOutput(
            finished_sending=res.finished_sending or None,
            finished_recving=res.finished_recving or None,
            failed_recving=res.failed_recving,
            invalid_block_ids=invalid,
        )
        mro = runner_output(rids, [toks[r] for r in rids], kvo)
        for out in self.sched.update_from_output(so, mro).values():
            for o in out.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    self.finished.add(o.request_id)
                if getattr(o, "kv_transfer_params", None):
                    self.params[o.request_id] = o.kv_transfer_params
        self.conn.take_events()
        self.steps += 1
        return so

    def run(self, reqs: list, max_steps: int = 500, on_meta: Optional[Any] = None) -> None:
        """Add reqs and step until all of them finished."""
        for r in reqs:
            self.add(r)
        want = {r.request_id for r in reqs}
        while not want <= self.finished:
            assert self.steps < max_steps, "requests did not finish: %s" % (want - self.finished)
            so = self.step(on_meta)
            if not so.total_num_scheduled_tokens:
                # Only requests waiting for their loads: a real engine's step
                # takes milliseconds, this one microseconds (a parked sidecar
                # may take its park slice, 10 ms, to see the loads).
                time.sleep(0.001)

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.conn.shutdown()

    @property
    def stats(self) -> dict:
        return self.conn.stats

    @property
    def wstats(self) -> dict:
        return self.worker.stats
