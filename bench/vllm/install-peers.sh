#!/usr/bin/env bash
# The peers of `make bench-vllm --connectors ...` that are not in the vLLM
# venv: LMCache (its multiprocess server and the engine side that vLLM's
# LMCacheMPConnector imports). vLLM's OffloadingConnector and ExampleConnector
# ship with vLLM and need nothing here.
#
#   bench/vllm/install-peers.sh VLLM_VENV PEERS_VENV     (make peers-venv)
#
# PEERS_VENV is a venv layered over VLLM_VENV: its own site-packages come
# first and then, through a .pth file, VLLM_VENV's, so it sees the same vLLM,
# torch and everything else without a 3 GB copy, and VLLM_VENV itself is never
# modified (the connector's tests keep running against the lock as written).
# Opt-in: CI never runs this (nothing in `make test` needs it).
#
# Pinned (with --no-deps: every dependency LMCache 0.5.6 needs is already in
# the vLLM lock, except the two named here). Idempotent: a marker holding the
# pins and the vLLM venv's own marker makes a second run a no-op.
set -euo pipefail

vllm_venv="${1:?usage: install-peers.sh VLLM_VENV PEERS_VENV}"
peers="${2:?usage: install-peers.sh VLLM_VENV PEERS_VENV}"
pins=(lmcache==0.5.6 sortedcontainers==2.4.0 opentelemetry-exporter-prometheus==0.66b2)
pip_version="26.3"

vllm_py="$vllm_venv/bin/python"
if [[ ! -x "$vllm_py" || ! -f "$vllm_venv/.ringside-vllm-installed" ]]; then
    echo "install-peers: no finished vLLM venv at $vllm_venv (make vllm-venv)" >&2
    exit 2
fi
vllm_venv="$(cd "$vllm_venv" && pwd -P)"
site="$("$vllm_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
want="${pins[*]} over $vllm_venv ($(cat "$vllm_venv/.ringside-vllm-installed"))"
marker="$peers/.ringside-peers-installed"
if [[ -f "$marker" && "$(cat "$marker")" == "$want" ]]; then
    echo "install-peers: $peers is up to date ($want); nothing to do"
    exit 0
fi

start=$(date +%s)
rm -rf "$peers"
# The same interpreter as the vLLM venv's (its home), so compiled wheels match.
base_py="$("$vllm_py" -c 'import sys; print(sys._base_executable)')"
"$base_py" -m venv "$peers"
own="$("$peers/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# addsitedir (not a bare path line) so that the vLLM venv's own .pth files run too.
echo "import site; site.addsitedir('$site')" >"$own/zz-ringside-vllm-venv.pth"
"$peers/bin/python" -m pip install --quiet --disable-pip-version-check "pip==$pip_version"
"$peers/bin/python" -m pip install --disable-pip-version-check --no-deps --progress-bar off "${pins[@]}"

# LMCache reports usage to the internet unless told not to; the benchmark sets
# these for every process it starts, and so does this check.
LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 "$peers/bin/python" - <<'EOF'
import importlib.metadata as md
import vllm, torch
import lmcache
from lmcache.v1.multiprocess import custom_types  # noqa: F401 - what LMCacheMPConnector imports
from vllm.platforms import current_platform as p
assert p.is_cpu(), type(p).__name__
print("install-peers: vllm %s, torch %s, lmcache %s" % (vllm.__version__, torch.__version__, md.version("lmcache")))
EOF
test -x "$peers/bin/lmcache" || { echo "install-peers: no lmcache command in $peers/bin" >&2; exit 1; }
echo "$want" >"$marker"
echo "install-peers: done in $(( $(date +%s) - start ))s"
