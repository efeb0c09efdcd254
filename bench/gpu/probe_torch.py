#!/usr/bin/env python3
"""What PyTorch's CUDA IPC handles and allocations look like to ringside.

vLLM's KV cache is torch tensors; the connector exports them with CUDA IPC
and the sidecar imports them with the driver API. One line per probe,
`PROBE <name>: <verdict> (<details>)`:

  torch-handle        untyped_storage()._share_cuda_() of 4 x
                      torch.zeros(512 MiB, int8): the handle's length,
                      version byte and type char
  torch-bases         how many distinct allocations (cuMemGetAddressRange
                      bases) the 4 tensors live in, at which offsets
  torch-handle-match  whether handle[2:66] equals cuIpcGetMemHandle of the
                      allocation's base (ctypes on libcuda.so.1)
  torch-hnd-strides   the strides of an HND-permuted view of a KV block
                      tensor (blocks, 2, 16 tokens, 8 heads, 128) in bf16
  torch-expandable    with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
                      (a subprocess): does _share_cuda_() succeed, with type
                      char 'e'
  torch-uuid          torch.cuda.get_device_properties(0).uuid against
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


def describe_handle(h: bytes) -> str:
    t = chr(h[1]) if len(h) > 1 and 32 <= h[1] < 127 else "?"
    return f"length {len(h)}, version byte {h[0] if h else '-'}, type char {t!r}"


EXPANDABLE = r"""
import torch
t = torch.zeros(%d, dtype=torch.int8, device="cuda")
try:
    h = t.untyped_storage()._share_cuda_()[1]
    t = chr(h[1]) if len(h) > 1 and 32 <= h[1] < 127 else "?"
    print("OK", len(h), h[0], t)
except Exception as e:
    print("FAIL", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
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
    tensors = [torch.zeros(TENSOR_BYTES, dtype=torch.int8, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
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

    shares = []

    def handle():
        for t in tensors:
            shares.append(t.untyped_storage()._share_cuda_())
        descs = sorted({describe_handle(s[1]) for s in shares})
        fields = len(shares[0])
        verdict(
            "torch-handle",
            descs[0] if len(descs) == 1 else "differs between tensors: " + "; ".join(descs),
            f"4 x torch.zeros({TENSOR_BYTES}, int8); _share_cuda_() returns {fields} fields; "
            f"storage offsets {[s[3] for s in shares]}, sizes {[s[2] for s in shares]}",
        )

    def bases():
        if drv is None:
            raise Missing("libcuda.so.1")
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

    def match():
        if drv is None:
            raise Missing("libcuda.so.1")
        if not shares:
            raise RuntimeError("no handles (torch-handle failed)")
        res = []
        for t, s in zip(tensors, shares):
            b, _ = drv.address_range(t.untyped_storage().data_ptr())
            mine = drv.ipc_handle(b)
            res.append(s[1][2:66] == mine)
        v = "equal" if all(res) else "not equal" if not any(res) else "equal for some"
        d = f"handle[2:66] == cuIpcGetMemHandle(base) per tensor: {res}; handle length {len(shares[0][1])}"
        verdict("torch-handle-match", v, d)

    def strides():
        kv = tensors[0].view(torch.bfloat16).view(-1, 2, 16, 8, 128)
        hnd = kv.permute(0, 1, 3, 2, 4)
        verdict(
            "torch-hnd-strides",
            f"strides {tuple(hnd.stride())}",
            f"NHD view {tuple(kv.shape)} strides {tuple(kv.stride())}; permute(0, 1, 3, 2, 4) shape "
            f"{tuple(hnd.shape)}, contiguous {hnd.is_contiguous()}, same storage {hnd.data_ptr() == kv.data_ptr()}",
        )

    def expandable_once(extra: dict) -> tuple[str, str]:
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **extra}
        r = subprocess.run([sys.executable, "-c", EXPANDABLE], env=env, capture_output=True, text=True, timeout=30)
        out = (r.stdout.strip().splitlines() or [""])[-1].split(" ", 3)
        if r.returncode != 0 or not out[0]:
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            return "the subprocess failed", f"exit {r.returncode}: {tail}"
        if out[0] == "OK" and len(out) == 4:
            v = "_share_cuda_ succeeds" + (" with type 'e'" if out[3] == "e" else f" with type {out[3]!r}")
            return v, f"handle length {out[1]}, version byte {out[2]}"
        return "_share_cuda_ fails", " ".join(out[1:])

    def expandable():
        v, d = expandable_once({})
        # Some builds export expandable segments only when asked to.
        v2, d2 = expandable_once({"TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC": "1"})
        verdict("torch-expandable", v, f"{d}; with TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=1: {v2} ({d2})")

    def uuid():
        if drv is None:
            raise Missing("libcuda.so.1")
        tu = str(torch.cuda.get_device_properties(0).uuid)
        mine = drv.uuid().hex()
        norm = tu.lower().removeprefix("gpu-").replace("-", "")
        verdict("torch-uuid", "equal" if norm == mine else "not equal", f"torch {tu}, cuDeviceGetUuid {mine}")

    for name, fn in [
        ("torch-handle", handle),
        ("torch-bases", bases),
        ("torch-handle-match", match),
        ("torch-hnd-strides", strides),
        ("torch-expandable", expandable),
        ("torch-uuid", uuid),
    ]:
        run(name, fn)
    return 1 if broke else 0


if __name__ == "__main__":
    sys.exit(main())
