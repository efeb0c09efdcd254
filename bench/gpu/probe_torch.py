#!/usr/bin/env python3
"""What ringside's engine side relies on of PyTorch on a GPU.

vLLM's KV cache is one torch.zeros(int8) buffer viewed per layer; the
connector exports its allocation with the driver (ctypes,
ringside/plugin/cudaipc.py: cuMemGetAddressRange, cuIpcGetMemHandle, or a
POSIX file descriptor for memory of the virtual memory API) and records its
store event on torch's current stream. (It no longer uses torch's own IPC,
``_share_cuda_``.) One line per probe, `PROBE <name>: <verdict> (<details>)`:

  torch-alloc       one torch.zeros(2 GiB, int8), as vLLM allocates its KV
                    cache: its allocation's base (cuMemGetAddressRange) is
                    the tensor's pointer, CU_POINTER_ATTRIBUTE_IS_LEGACY_
                    CUDA_IPC_CAPABLE is 1, and cuIpcGetMemHandle succeeds
  torch-bases       how many distinct allocations 4 x torch.zeros(512 MiB)
                    live in, at which offsets
  torch-stream      torch.cuda.current_stream().cuda_stream (0: the legacy
                    default stream, what the store event is recorded on)
  torch-expandable  with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
                    (a subprocess): IS_LEGACY_CUDA_IPC_CAPABLE of the
                    buffer, and what ringside's from_block_tensors makes of
                    it (refused, naming the setting, or shared by file
                    descriptor)
  torch-uuid        torch.cuda.get_device_properties(0).uuid against
                    cuDeviceGetUuid

Without torch or without a CUDA device it prints `PROBE torch: skipped (no
CUDA torch)` and exits 0. The exit status is 1 only when a probe itself
broke (verdict `error`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cudrv  # noqa: E402
from cudrv import CudaError, Missing  # noqa: E402

MIB = 1 << 20
TENSOR_BYTES = 512 * MIB


def verdict(name: str, v: str, details: str) -> None:
    print(f"PROBE {name}: {v} ({details})", flush=True)


EXPANDABLE = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import torch
import cudrv
from ringside.plugin.region import RegionError, from_block_tensors
t = torch.zeros(%d, dtype=torch.int8, device="cuda")
drv = cudrv.Driver()
r, legacy = drv.pointer_attr(cudrv.ATTR_LEGACY_IPC, t.data_ptr())
try:
    reg = from_block_tensors({"model.layers.0.attn": t.view(64, -1)}, 64)
    print("OK", r, legacy, "kind", reg.kind)
except RegionError as e:
    print("OK", r, legacy, "refused", str(e).replace(chr(10), " "))
""" % (TENSOR_BYTES,)


def main() -> int:
    try:
        import torch
    except ImportError:
        verdict("torch", "skipped", "no CUDA torch: torch is not installed")
        return 0
    if not torch.cuda.is_available():
        verdict("torch", "skipped", f"no CUDA torch: torch {torch.__version__}, torch.cuda.is_available() is False")
        return 0
    print(
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, device 0: {torch.cuda.get_device_name(0)}",
        flush=True,
    )
    broke = False
    torch.zeros(1, device="cuda")  # torch's primary context, current on this thread
    drv = None
    try:
        drv = cudrv.Driver()  # after torch: its primary context is current
    except (OSError, Missing, CudaError) as e:
        print(f"driver API through ctypes unavailable: {e}", flush=True)

    def run(name, fn):
        nonlocal broke
        try:
            fn()
        except Missing as e:
            verdict(name, "unsupported by this driver", f"{e.name} missing")
        except CudaError as e:
            verdict(name, "refused", str(e))
        except Exception as e:  # noqa: BLE001 (a bug in the probe, not an answer: reported, the rest run)
            broke = True
            verdict(name, "error", f"{type(e).__name__}: {e}")
            traceback.print_exc()

    def alloc():
        if drv is None:
            raise Missing("libcuda.so.1")
        t = torch.zeros(4 * TENSOR_BYTES, dtype=torch.int8, device="cuda")
        torch.cuda.synchronize()
        p = t.data_ptr()
        base, size = drv.address_range(p)
        r, legacy = drv.pointer_attr(cudrv.ATTR_LEGACY_IPC, p)
        h = drv.ipc_handle(base)
        ok = base == p and r == 0 and legacy == 1 and len(h) == 64
        verdict(
            "torch-alloc",
            "one exportable allocation" if ok else "not as the connector expects",
            f"torch.zeros({4 * TENSOR_BYTES}, int8): pointer {p:#x}, allocation base {base:#x} size {size}; "
            f"IS_LEGACY_CUDA_IPC_CAPABLE {legacy if r == 0 else drv.describe(r)}; cuIpcGetMemHandle ok",
        )
        del t

    tensors = []

    def bases():
        if drv is None:
            raise Missing("libcuda.so.1")
        tensors.extend(torch.zeros(TENSOR_BYTES, dtype=torch.int8, device="cuda") for _ in range(4))
        rows = []
        for t in tensors:
            p = t.untyped_storage().data_ptr()
            b, n = drv.address_range(p)
            rows.append((p, b, n))
        distinct = sorted({b for _, b, _ in rows})
        verdict(
            "torch-bases",
            f"{len(distinct)} distinct allocation base(s) for 4 tensors",
            "; ".join(f"ptr {p:#x} = base {b:#x} + {p - b}, allocation {n} B" for p, b, n in rows),
        )
        tensors.clear()

    def stream():
        cur = torch.cuda.current_stream()
        v = "the legacy default stream (0)" if cur.cuda_stream == 0 else f"stream {cur.cuda_stream:#x}"
        verdict("torch-stream", v, f"torch.cuda.current_stream().cuda_stream on the main thread: {cur!r}")

    def expandable():
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        here = os.path.dirname(os.path.abspath(__file__))
        env["PYTHONPATH"] = os.pathsep.join([here, os.path.join(here, "..", "..", "connector", "python")])
        r = subprocess.run(
            [sys.executable, "-c", EXPANDABLE, here], env=env, capture_output=True, text=True, timeout=40
        )
        out = (r.stdout.strip().splitlines() or [""])[-1].split(" ", 4)
        if r.returncode != 0 or out[0] != "OK" or len(out) < 5:
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            verdict("torch-expandable", "the subprocess failed", f"exit {r.returncode}: {tail}")
            return
        legacy = out[2] if out[1] == "0" else f"unreadable (error {out[1]})"
        what = "refused by the connector" if out[3] == "refused" else f"shared as region kind {out[4]}"
        verdict("torch-expandable", what, f"IS_LEGACY_CUDA_IPC_CAPABLE {legacy}; {out[4]}")

    def uuid():
        if drv is None:
            raise Missing("libcuda.so.1")
        tu = str(torch.cuda.get_device_properties(0).uuid)
        mine = drv.uuid().hex()
        norm = tu.lower().removeprefix("gpu-").replace("-", "")
        verdict("torch-uuid", "equal" if norm == mine else "not equal", f"torch {tu}, cuDeviceGetUuid {mine}")

    for name, fn in [
        ("torch-alloc", alloc),
        ("torch-bases", bases),
        ("torch-stream", stream),
        ("torch-expandable", expandable),
        ("torch-uuid", uuid),
    ]:
        run(name, fn)
    return 1 if broke else 0


if __name__ == "__main__":
    sys.exit(main())
