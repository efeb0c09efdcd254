#!/usr/bin/env bash
# Install SGLang's HiCache storage interface (PyPI `sglang` 0.5.23, without its
# GPU runtime) into a private venv, from PyPI alone, for the tests of the
# ringside HiCache storage backend (connector/python/ringside/sglang.py).
#
#   connector/python/scripts/install-sglang.sh [VENV_DIR]   (default: <repo>/.venv-sglang)
#
# Idempotent: a marker file holding the lock file's sha256 makes a second run
# a no-op; a changed lock file (or a half-finished install) triggers a rebuild.
#
# Why it is done this way:
#   * `sglang` 0.5.23 requires torch==2.14.1 and many CUDA-only packages
#     (flashinfer, sglang-kernel, deep-gemm, flash-mla, ...). The backend and
#     its tests need only the storage interface (mem_cache/hicache_storage.py),
#     the backend factory (mem_cache/storage/backend_factory.py) and the host
#     pool classes (mem_cache/pool_host/*, memory_pool_host.py), which run on
#     CPU tensors. sglang is installed with --no-deps and the lock lists only
#     what those modules import (found by importing them), plus pytest.
#   * torch 2.14.1 (sglang's pin) from PyPI is the CUDA build, so the nvidia-* /
#     cuda-* wheels must be present (about 3 GB) even though no GPU is used.
#   * Every package is pinned in sglang-cpu-lock.txt and installed with
#     --no-deps, so pip never tries to resolve sglang's GPU requirements.
#   * This venv cannot run an SGLang engine on CPU (see docs/sglang.md).
#
# Env: PYTHON (default python3, must be 3.11 for the lock as written).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
venv="${1:-$repo/.venv-sglang}"
lock="$here/sglang-cpu-lock.txt"
py="${PYTHON:-python3}"
marker="$venv/.ringside-sglang-installed"
pip_version="26.3"

want="$(sha256sum "$lock" | cut -d' ' -f1)"
if [[ -f "$marker" && "$(cat "$marker")" == "$want" ]]; then
    echo "install-sglang: $venv is up to date (lock $want); nothing to do"
    exit 0
fi

case "$(uname -m)" in
    x86_64) ;;
    *) echo "install-sglang: only x86_64 is supported (got $(uname -m))" >&2; exit 2 ;;
esac
pyver="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ "$pyver" != "3.11" ]]; then
    echo "install-sglang: warning: lock was made with python 3.11, $py is $pyver" >&2
fi

start=$(date +%s)
rm -rf "$venv"
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "pip==$pip_version"
t_venv=$(date +%s)

echo "install-sglang: installing $(grep -cvE '^\s*(#|$)' "$lock") pinned packages into $venv (about 3 GB download) ..."
"$venv/bin/python" -m pip install --disable-pip-version-check --no-deps \
    --progress-bar off -r "$lock"
t_pip=$(date +%s)

# Smoke-check the modules the backend and its tests use (no model, no GPU).
"$venv/bin/python" -W ignore - <<'PYEOF'
import torch
import sglang
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
import sglang.srt.mem_cache.memory_pool_host
print(f"install-sglang: torch {torch.__version__}, sglang {sglang.__version__}: HiCache storage interface importable")
PYEOF
end=$(date +%s)

echo "$want" > "$marker"
echo "install-sglang: done in $((end - start))s (venv+pip $((t_venv - start))s, packages $((t_pip - t_venv))s, check $((end - t_pip))s); size $(du -sh "$venv" | cut -f1)"
