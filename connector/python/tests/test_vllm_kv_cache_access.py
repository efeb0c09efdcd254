"""What the connector declares to vLLM 0.34 about its use of the KV cache
(``RingsideConnector.kv_cache_access``, ringside/vllm/access.py), and what
vLLM 0.34's own code does with it.

On a CUDA engine the plugin key ``kv_cache_access`` chooses: ``exports_fd``
(the default) keeps 0.34's extensible KV cache, allocated exportable as
POSIX file descriptors, which the workers send to the sidecar;
``legacy_ipc`` makes 0.34 turn that cache off, and the workers share the
cache through legacy CUDA IPC. Where a choice cannot work, the engine stops
at start with one message naming the key. Elsewhere (this CPU build) the
connector declares IN_PROCESS.

vLLM 0.34 has no CPU build on PyPI: these tests run in the child process of
test_vllm_versions.py::test_unit_tests_under_vllm[0.34.0], which imports
0.34's Python sources (``make vllm-src``) over the vLLM venv. The
configuration code runs as it is, with the platform's answers (CUDA, an
IMEX channel or not) stood in for, since no GPU is here. Under an older
vLLM (no ``KVCacheAccess``) the module is skipped.
"""

from __future__ import annotations

import logging

import pytest
import vllm
import vllm_harness as H  # skips this module where vLLM is not importable

try:
    from vllm.config.kv_transfer import KVCacheAccess, KVTransferConfig
except ImportError:  # vLLM before 0.34
    pytest.skip("vLLM %s has no KVCacheAccess (0.34 and later)" % vllm.__version__, allow_module_level=True)

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from ringside.vllm import RingsideConnector, register_plugin

RINGSIDE = dict(kv_connector="RingsideConnector", kv_connector_module_path="ringside.vllm", kv_role="kv_both")
# NixlConnector on device memory: REGISTERS | EXPORTS_FABRIC (UCX cuda_ipc within a host).
NIXL = dict(kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_device="cuda")
# Imported now, while the platform answers as this CPU does: under the
# stood-in CUDA platform their imports would reach for CUDA kernels.
KVConnectorFactory.get_connector_class(KVTransferConfig(**NIXL))
from vllm.v1.worker.extensible_kv_cache import kv_cache_export_handle_types  # noqa: E402

LEGACY = dict(RINGSIDE, kv_connector_extra_config={"kv_cache_access": "legacy_ipc"})
FD, IPC, FABRIC, REG = (
    KVCacheAccess.EXPORTS_FD,
    KVCacheAccess.LEGACY_IPC,
    KVCacheAccess.EXPORTS_FABRIC,
    KVCacheAccess.REGISTERS,
)


def multi(*children: dict) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={"connectors": list(children)}
    )


@pytest.fixture
def cuda(monkeypatch):
    """The platform answering as CUDA does (no GPU here)."""
    from vllm.platforms import current_platform

    for name, v in (("is_cuda", True), ("is_cuda_alike", True), ("is_rocm", False)):
        monkeypatch.setattr(current_platform, name, lambda v=v: v, raising=False)


def test_on_this_cpu_the_connector_asks_for_nothing():
    """The CPU build (or ROCm): IN_PROCESS whatever the key says, since
    0.34 refuses EXPORTS_FD where its extensible cache is unsupported."""
    for kvt in (KVTransferConfig(**RINGSIDE), KVTransferConfig(**LEGACY)):
        assert RingsideConnector.kv_cache_access(kvt) is KVCacheAccess.IN_PROCESS
        assert kvt.kv_cache_access() == KVCacheAccess.IN_PROCESS


def test_the_declaration_on_cuda(cuda):
    kvt = KVTransferConfig(**RINGSIDE)
    assert RingsideConnector.kv_cache_access(kvt) is FD
    # As vLLM asks: through its factory, by module path and by the plugin's registered name.
    assert KVConnectorFactory.kv_cache_access(kvt) == FD
    assert kvt.kv_cache_access() == FD
    if "RingsideConnector" not in KVConnectorFactory._registry:
        register_plugin()
    by_name = KVTransferConfig(kv_connector="RingsideConnector", kv_role="kv_both")
    assert by_name.kv_cache_access() == FD
    # One physical allocation per segment: what a descriptor export needs.
    assert kvt.registers_kv_cache_memory()
    legacy = KVTransferConfig(**LEGACY)
    assert legacy.kv_cache_access() == IPC and not legacy.registers_kv_cache_memory()


def test_a_bad_value_is_named(cuda):
    kvt = KVTransferConfig(**dict(RINGSIDE, kv_connector_extra_config={"kv_cache_access": "fd"}))
    with pytest.raises(ValueError, match="kv_cache_access"):
        kvt.kv_cache_access()


def test_beside_nixl_under_multiconnector(cuda):
    """0.34's MultiConnector ORs its children's flags: NIXL's and ringside's,
    in either order."""
    assert multi(NIXL).kv_cache_access() == REG | FABRIC
    assert multi(NIXL, RINGSIDE).kv_cache_access() == REG | FABRIC | FD
    assert multi(RINGSIDE, NIXL).kv_cache_access() == REG | FABRIC | FD
    assert multi(NIXL, LEGACY).kv_cache_access() == REG | FABRIC | IPC
    assert multi(NIXL, LEGACY).registers_kv_cache_memory()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def on_cuda(cuda, monkeypatch):
    """0.34's resolution of its extensible KV cache on CUDA; imex says
    whether an IMEX channel exists. Returns resolve(kv_transfer_config,
    requested=None, imex=True, **cache): (enable_extensible_kv_cache,
    resolved_gpu_memory_utilization, vLLM's log lines, the export handle
    types 0.34's workers request), or the ValueError that stops the
    engine's start."""
    import vllm.utils.vmm_driver as vmm

    log = logging.getLogger("vllm.config.vllm")

    def resolve(kvt, requested=None, imex=True, **cache):
        vc = H.vllm_config({"socket": "/nonexistent"})
        vc.kv_transfer_config = kvt
        cc = vc.cache_config
        cc._extensible_kv_cache_resolved = False  # resolved once already, for this CPU
        cc.enable_extensible_kv_cache = requested
        for k, v in cache.items():
            setattr(cc, k, v)
        monkeypatch.setattr(vmm, "imex_channel_available", lambda: imex)
        rec, level = _Records(), log.level
        log.addHandler(rec)
        log.setLevel(logging.DEBUG)
        try:
            vc._resolve_extensible_kv_cache()
        finally:
            log.setLevel(level)
            log.removeHandler(rec)
        return (
            cc.enable_extensible_kv_cache,
            cc.resolved_gpu_memory_utilization,
            rec.lines,
            (kv_cache_export_handle_types(vc)),
        )

    return resolve


def test_exports_fd_keeps_vllms_extensible_cache(on_cuda):
    """The default: 0.34's extensible cache stays on (gpu_memory_utilization
    1.0), its segments requested exportable as POSIX file descriptors."""
    assert on_cuda(None)[:3] == (True, 1.0, [])
    on, util, lines, types = on_cuda(KVTransferConfig(**RINGSIDE))
    assert (on, util, lines) == (True, 1.0, [])
    assert types == vmm_fd()


def vmm_fd() -> int:
    from vllm.utils.vmm_driver import MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

    return MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


@pytest.mark.parametrize(
    "requested, cache, why",
    [
        (False, {}, "--no-enable-extensible-kv-cache"),
        (None, {"kv_cache_memory_bytes": 8 << 30}, "kv_cache_memory_bytes"),
        (None, {"num_gpu_blocks_override": 1000}, "num_gpu_blocks_override"),
    ],
)
def test_exports_fd_where_vllm_cannot_have_it_stops_with_the_key(on_cuda, requested, cache, why):
    """Where the extensible cache cannot be on, 0.34 refuses EXPORTS_FD at
    start; the connector says so first, naming the key and what to set."""
    for kvt in (KVTransferConfig(**RINGSIDE), multi(NIXL, RINGSIDE)):
        with pytest.raises(ValueError) as e:
            on_cuda(kvt, requested=requested, **cache)
        msg = str(e.value)
        assert "kv_cache_access" in msg and "legacy_ipc" in msg and why in msg, msg
    # With legacy_ipc the same engine starts, without the extensible cache.
    assert on_cuda(KVTransferConfig(**LEGACY), requested=requested, **cache)[:2] == (False, 0.92)


def test_legacy_ipc_turns_the_extensible_cache_off(on_cuda, monkeypatch):
    """legacy_ipc: off without a word from vLLM (the connector logs why),
    gpu_memory_utilization defaults to 0.92; asking for the extensible cache
    stops the start, naming the key."""
    assert on_cuda(KVTransferConfig(**LEGACY))[:3] == (False, 0.92, [])
    with pytest.raises(ValueError, match="kv_cache_access is legacy_ipc"):
        on_cuda(KVTransferConfig(**LEGACY), requested=True)
    # Without any declaration (vLLM's default, IN_PROCESS) it would be on,
    # in memory that nothing exports.
    monkeypatch.setattr(RingsideConnector, "kv_cache_access", classmethod(lambda cls, kvt: KVCacheAccess.IN_PROCESS))
    assert on_cuda(KVTransferConfig(**RINGSIDE))[:3] == (True, 1.0, [])
    assert on_cuda(KVTransferConfig(**RINGSIDE))[3] == 0


def test_beside_nixl_both_choices_start(on_cuda):
    """Beside NixlConnector both start. With exports_fd the extensible cache
    is on and the workers request descriptors and FABRIC handles together,
    which 0.34 turns into FABRIC alone where an IMEX channel exists (its
    vmm_driver.py): the sidecar cannot import that, and the connector's
    refusal then names the key (test_cuda_fd.py). With legacy_ipc the cache
    is off and both children share it as in 0.33."""
    from vllm.utils.vmm_driver import MEM_HANDLE_TYPE_FABRIC

    for imex in (True, False):
        on, _, _, types = on_cuda(multi(NIXL, RINGSIDE), imex=imex)
        assert on and types == vmm_fd() | MEM_HANDLE_TYPE_FABRIC
        assert on_cuda(multi(NIXL, LEGACY), imex=imex)[:2] == (False, 0.92)
        assert on_cuda(multi(LEGACY, NIXL), imex=imex)[:2] == (False, 0.92)
