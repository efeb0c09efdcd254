"""What the connector declares to vLLM 0.34 about its use of the KV cache
(``RingsideConnector.kv_cache_access``), and what vLLM 0.34's own code does
with it.

The workers share the engine's KV cache with the sidecar through legacy
CUDA IPC (ringside/plugin/cudaipc.py), which cannot export memory mapped
with the driver's virtual memory API; 0.34 allocates its "extensible" KV
cache so on CUDA by default. The connector declares
``KVCacheAccess.LEGACY_IPC``, and 0.34 then turns that cache off
(``VllmConfig._resolve_extensible_kv_cache`` in vllm/config/vllm.py).

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
LEGACY_MESSAGE = (
    "enable_extensible_kv_cache: a KV connector (e.g. LMCacheMPConnector) shares the KV cache "
    "through legacy CUDA IPC, which cannot export driver-mapped memory."
)


def multi(*children: dict) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={"connectors": list(children)}
    )


def test_the_connector_declares_legacy_ipc():
    kvt = KVTransferConfig(**RINGSIDE)
    assert RingsideConnector.kv_cache_access(kvt) is KVCacheAccess.LEGACY_IPC
    # As vLLM asks: through its factory, by module path and by the plugin's registered name.
    assert KVConnectorFactory.kv_cache_access(kvt) == KVCacheAccess.LEGACY_IPC
    assert kvt.kv_cache_access() == KVCacheAccess.LEGACY_IPC
    if "RingsideConnector" not in KVConnectorFactory._registry:
        register_plugin()
    by_name = KVTransferConfig(kv_connector="RingsideConnector", kv_role="kv_both")
    assert by_name.kv_cache_access() == KVCacheAccess.LEGACY_IPC
    # Not a connector that needs one physical allocation per segment.
    assert not kvt.registers_kv_cache_memory()


def test_beside_nixl_under_multiconnector():
    """0.34's MultiConnector ORs its children's flags: NIXL's and ringside's,
    in either order."""
    assert multi(NIXL).kv_cache_access() == KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC
    want = KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC | KVCacheAccess.LEGACY_IPC
    assert multi(NIXL, RINGSIDE).kv_cache_access() == want
    assert multi(RINGSIDE, NIXL).kv_cache_access() == want
    # NIXL still registers its memory: one physical allocation per segment.
    assert multi(NIXL, RINGSIDE).registers_kv_cache_memory()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def on_cuda(monkeypatch):
    """0.34's resolution of its extensible KV cache, with the platform
    answering as CUDA does (no GPU here); imex says whether an IMEX channel
    exists. Returns resolve(kv_transfer_config, requested=None, imex=True):
    (enable_extensible_kv_cache, resolved_gpu_memory_utilization, log
    lines), or the ValueError that stops the engine's start."""
    import vllm.utils.vmm_driver as vmm
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True, raising=False)
    monkeypatch.setattr(current_platform, "is_rocm", lambda: False, raising=False)
    log = logging.getLogger("vllm.config.vllm")

    def resolve(kvt, requested=None, imex=True):
        vc = H.vllm_config({"socket": "/nonexistent"})
        vc.kv_transfer_config = kvt
        cc = vc.cache_config
        cc._extensible_kv_cache_resolved = False  # resolved once already, for this CPU
        cc.enable_extensible_kv_cache = requested
        monkeypatch.setattr(vmm, "imex_channel_available", lambda: imex)
        rec, level = _Records(), log.level
        log.addHandler(rec)
        log.setLevel(logging.DEBUG)
        try:
            vc._resolve_extensible_kv_cache()
        finally:
            log.setLevel(level)
            log.removeHandler(rec)
        return cc.enable_extensible_kv_cache, cc.resolved_gpu_memory_utilization, rec.lines

    return resolve


def test_vllm_turns_the_extensible_cache_off(on_cuda, monkeypatch):
    # Without a connector, or with NIXL and an IMEX channel: on, and
    # gpu_memory_utilization defaults to 1.0.
    assert on_cuda(None) == (True, 1.0, [])
    assert on_cuda(multi(NIXL)) == (True, 1.0, [])
    # NIXL without an IMEX channel: off, and vLLM says why (which shows that
    # its log lines are seen here).
    on, util, lines = on_cuda(multi(NIXL), imex=False)
    assert (on, util) == (False, 0.92) and len(lines) == 1 and "without an IMEX channel" in lines[0], lines
    # With ringside: off without a word from vLLM, and gpu_memory_utilization
    # defaults to 0.92 again; the engine starts.
    assert on_cuda(KVTransferConfig(**RINGSIDE)) == (False, 0.92, [])
    # Beside NIXL, with or without an IMEX channel: off, for ringside.
    assert on_cuda(multi(NIXL, RINGSIDE)) == (False, 0.92, [])
    assert on_cuda(multi(RINGSIDE, NIXL), imex=False) == (False, 0.92, [])
    # Without the declaration (vLLM's default, IN_PROCESS) it would be on,
    # in memory that CUDA IPC cannot export.
    monkeypatch.setattr(RingsideConnector, "kv_cache_access", classmethod(lambda cls, kvt: KVCacheAccess.IN_PROCESS))
    assert on_cuda(KVTransferConfig(**RINGSIDE)) == (True, 1.0, [])


def test_asking_for_the_extensible_cache_with_ringside_stops_the_start(on_cuda):
    """--enable-extensible-kv-cache with the connector: vLLM refuses at
    start, naming legacy CUDA IPC."""
    for kvt in (KVTransferConfig(**RINGSIDE), multi(NIXL, RINGSIDE)):
        with pytest.raises(ValueError) as e:
            on_cuda(kvt, requested=True)
        assert str(e.value) == LEGACY_MESSAGE
    # Turned off explicitly: fine.
    assert on_cuda(KVTransferConfig(**RINGSIDE), requested=False)[:2] == (False, 0.92)
